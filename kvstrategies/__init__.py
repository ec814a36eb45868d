"""kvstrategies package."""
