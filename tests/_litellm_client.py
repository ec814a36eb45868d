"""Child process of tests/test_clients.py: LiteLLM against a live `unikv serve`.

    python tests/_litellm_client.py BASE_URL MODEL REQUEST_JSON

REQUEST_JSON holds `messages` (one chat), `prompt` (one completion prompt) and `max_tokens`.
Asks, greedily, `litellm.completion` for the chat (whole, then streamed with usage) and
`litellm.text_completion` for the prompt, through LiteLLM's OpenAI-compatible provider
(`openai/MODEL` at BASE_URL/v1), and prints what came back as one JSON object:
{"chat": ..., "stream": ..., "text": ...}, each with `text`, `finish_reason` and `usage`.

A process of its own: litellm's import loads thousands of modules, adds log handlers and starts
a logging thread, none of which belongs in the test session. The parent sets
LITELLM_LOCAL_MODEL_COST_MAP (no cost-map download) and installs tests/_no_network.py.
"""

from __future__ import annotations

import json
import sys


def usage(u) -> dict:
    return {k: getattr(u, k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def main(url: str, model: str, request: dict) -> dict:
    import litellm

    litellm.suppress_debug_info = True
    args = dict(model=f"openai/{model}", api_base=url + "/v1", api_key="unused", temperature=0,
                max_tokens=request["max_tokens"], timeout=120, num_retries=0)  # fmt: skip
    out = {}
    r = litellm.completion(messages=request["messages"], **args)
    choice = r.choices[0]
    out["chat"] = {"text": choice.message.content, "finish_reason": choice.finish_reason,
                   "usage": usage(r.usage)}  # fmt: skip

    chunks = list(litellm.completion(messages=request["messages"], stream=True,
                                     stream_options={"include_usage": True}, **args))  # fmt: skip
    with_choices = [c for c in chunks if c.choices]
    out["stream"] = {
        "text": "".join(c.choices[0].delta.content or "" for c in with_choices),
        "finish_reason": next(
            (c.choices[0].finish_reason for c in reversed(with_choices)
             if c.choices[0].finish_reason), None),
        "usage": next(usage(c.usage) for c in reversed(chunks) if getattr(c, "usage", None)),
    }  # fmt: skip

    t = litellm.text_completion(prompt=request["prompt"], **args)
    out["text"] = {"text": t.choices[0].text, "finish_reason": t.choices[0].finish_reason,
                   "usage": usage(t.usage)}  # fmt: skip
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
