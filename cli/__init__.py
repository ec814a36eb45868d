"""The `unikv` command, the top floor: every command (`main`: run, eval, profile, calibrate,
cache, tune, ...) and `serve` (`serve`) like any other, over the floors below.
"""
