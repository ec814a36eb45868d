"""unikv: a KV-cache and memory-management service for LLM inference.

One import namespace over the repository's floors (setuptools maps each to its folder):

    unikv.serving       the OpenAI-compatible server, replicas, health, the `unikv` command
    unikv.engine        the attention + MoE engine and its async API (`unikv.engine.Engine`)
    unikv.kvstrategies  how keys and values are stored (formats, placements, selections)
    unikv.kernels       the operator registry and the C kernels (in unikv/kernels/, not at the root:
                        a root folder `kernels` would hide Hugging Face's package of that name)
    unikv.memory        the unified memory pool, its tiers, config files and chip profiles
    unikv.storage       block stores under the SSD and remote tiers (LMDB, files, Redis)

Dependencies point down only: a floor imports the floors below it, never above.
"""


def version() -> str:
    """The installed package's version (importlib.metadata), or "unknown" outside an install."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("unikv")
    except PackageNotFoundError:
        return "unknown (not installed)"
