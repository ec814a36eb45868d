"""`unikv advise --url URL`: a running server's health colour and what to change, as a list.

Reads the server's `/health` (open without the key, so a probe's view is the operator's) and
prints the colour, the reasons it is not green, and each piece of advice: the config key, its
value now and the value to set, and the measurement behind it (`serving.advice` has the
rules). Exit code 0 when there is nothing to change, 1 when there is advice, 2 when the
server cannot be read.
"""

from __future__ import annotations

import argparse

EX_ADVICE = 1


def add_advise(sub, epilog: str) -> None:
    """The `advise` command's parser."""
    adv = sub.add_parser(
        "advise",
        help="what a running server's health view advises to change",
        description=(
            "Ask a running `unikv serve` for its health colour and advice: each piece names the "
            "measurement, its value against the threshold, and the config key with the value "
            "to set. Exit code 0: nothing to change; 1: advice given; 2: the server could not "
            "be read."
        ),
        epilog=epilog,
    )
    adv.add_argument("--url", default="http://127.0.0.1:8000",
                     help="the server's base URL (default: http://127.0.0.1:8000)")  # fmt: skip
    adv.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (10)")
    adv.add_argument("--json", action="store_true",
                     help="print the /health body as one JSON object")  # fmt: skip


def run_advise(args: argparse.Namespace) -> tuple[dict, int]:
    """Read `/health` and print it for a person: (the body, exit code)."""
    import httpx

    url = args.url.rstrip("/") + "/health"
    try:
        r = httpx.get(url, timeout=args.timeout)
        body = r.json()
    except (httpx.HTTPError, ValueError) as e:
        raise ValueError(f"cannot read {url}: {e}") from None
    if not isinstance(body, dict) or "status" not in body:
        raise ValueError(f"{url} answered {r.status_code} without a health view: is it unikv?")
    advice = body.get("advice") or []
    print(f"health: {body['status']} (admitting {body.get('load_share', 0):.0%} of full load)")
    for reason in body.get("reasons", []):
        print(f"  - {reason}")
    if not advice:
        print("advice: nothing to change")
        return body, 0
    print("advice:")
    for a in advice:
        print(f"  * {a['key']}: {a['current']} -> {a['suggested']}")
        print(f"    {a['text']}")
    return body, EX_ADVICE
