"""The application's settings, the lowest floor: config files and their environment overrides
(`config`: `PoolConfig` with its tiers, scheduler, thermal and MoE tables), the chip profiles
shipped as package data (`chips/*.toml`) with their bandwidth probes and classes (`profiles`),
and the logging setup every command shares (`logs`). It imports nothing else of unikv.
"""
