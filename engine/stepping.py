"""One planned step run: the forward pass over the batch, then sampling and the
log-probabilities each request asked for; a batch that fails is run again request by request,
so one request's failure stays its own.

What does not live here: planning the step (`engine.scheduler`), what a sampled token does to
its request (`engine.requests.advance`), the loop (`engine.engine`).
"""

from __future__ import annotations

import logging

import torch

from unikv.kvstrategies.kv import KVCache, StepBatch

from .requests import Request
from .sampling import greedy_rows, logprobs_of, sample, spec, uniform
from .scheduler import Work

log = logging.getLogger("unikv.engine.engine")  # the engine's logger: its messages are the loop's


class StepRunner:
    """Runs planned steps through `model` over the KV cache `kv`."""

    def __init__(self, model, kv: KVCache, tokenizer) -> None:
        self.model, self.kv, self.tokenizer = model, kv, tokenizer
        # id(work) -> the log-probabilities its last step computed ("prompt", "token")
        self.logprobs: dict[int, dict] = {}

    def run(
        self, plan: list[Work[Request]], steps: int = 1
    ) -> list[tuple[Work[Request], object]] | None:
        """Run the batch; if it fails, rerun each request alone so one failure stays its own.

        With `steps` > 1, a plan of greedy decodes (`Engine._sequential`) runs as that many
        steps in one native call (`LlamaModel.decode`): each request's outcome is then the list
        of its tokens; None where the model could not run it so (nothing changed: the caller
        runs the plan step by step).

        NOTE: a forward pass that raises has rolled its KV back (`kv.abort_step`, before the
        commit), so running the requests again appends nothing twice; what follows the commit
        (sampling) fails per request inside `_execute` and never reaches this retry."""
        if steps > 1:
            return self._decode(plan, steps)
        try:
            return list(zip(plan, self._execute(plan), strict=True))
        except Exception as batch_error:
            if len(plan) == 1:
                return [(plan[0], batch_error)]
            log.warning("batched step failed (%s); retrying requests one by one", batch_error)
            out = []
            for work in plan:
                try:
                    out.append((work, self._execute([work])[0]))
                except Exception as e:
                    out.append((work, e))
            return out

    def _decode(
        self, plan: list[Work[Request]], steps: int
    ) -> list[tuple[Work[Request], object]] | None:
        """`run` of `steps` decode steps, greedy or sampled (gemv.c's draw, `sampling.draw`);
        a failure is every request's (the cache rolled the run back: nothing was stored).

        A sampled request's uniform numbers are taken from its generator before the call, one
        a step, as its steps one a turn would take them (`sampling.draw`): the same tokens
        either way. Where the run does not happen, its generators are set back."""
        for w in plan:  # room for the run's tokens (the scheduler reserved one step's)
            if not self.kv.reserve(w.req.rid, steps):
                return None
        rows = draws = None
        sampled = [w for w in plan if not w.req.params.greedy]
        held = [(g, g.get_state()) for w in sampled if (g := w.req.gen) is not None]
        if sampled:
            rows = torch.tensor([spec(w.req.params) for w in plan], dtype=torch.float64)
            draws = torch.zeros(steps, len(plan), dtype=torch.float64)
            for i, w in enumerate(plan):
                if not w.req.params.greedy:
                    draws[:, i] = torch.tensor([uniform(w.req.gen) for _ in range(steps)],
                                               dtype=torch.float64)  # fmt: skip
        got = None
        try:
            got = self.model.decode([w.tokens[0] for w in plan],
                                    [w.req.num_computed for w in plan], self.kv,
                                    [w.req.rid for w in plan], steps, rows, draws)  # fmt: skip
        except Exception as e:  # (rolled back: step by step, each failure stays its own)
            log.warning("sequential decode failed (%s); stepping one token at a time", e)
        finally:
            if got is None:
                for gen, state in held:
                    gen.set_state(state)
        if got is None:
            return None
        tokens = got[0].t().tolist()  # per request, its steps' tokens
        return list(zip(plan, tokens, strict=True))

    def _execute(self, plan: list[Work[Request]]) -> list[int | BaseException | None]:
        """One forward pass over the plan; returns per work item the sampled token, None (a
        prompt chunk), or the exception its own sampling raised: after the step's KV is
        committed nothing fails for the batch."""
        tokens, positions, rows = [], [], []
        spans = []  # per item: its rows in the logits (prompt logprobs: all, else the last)
        for w in plan:
            start = w.req.num_computed
            first = len(tokens)
            tokens.extend(w.tokens)
            positions.extend(range(start, start + len(w.tokens)))
            if w.req.wants_prompt_logits and start < len(w.req.prompt_ids):
                span = range(len(rows), len(rows) + len(w.tokens))
                rows.extend(range(first, len(tokens)))
            elif w.needs_logits:
                span = range(len(rows), len(rows) + 1)
                rows.append(len(tokens) - 1)
            else:
                span = range(0)
            spans.append(span)
        batch = StepBatch(
            [w.req.rid for w in plan],
            [len(w.tokens) for w in plan],
            [not w.needs_logits for w in plan],  # a prompt chunk that more of the prompt follows
        )
        dev = self.model.device
        logits = self.model.forward(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv,
            batch,
            torch.tensor(rows, dtype=torch.long, device=dev),
        )
        # Greedy requests take their rows' argmax from one call over all of them (`greedy_rows`),
        # where the step's rows are only the ones sampled (not a prompt's rows of logprobs)
        greedy = None
        if len(rows) <= len(plan) and any(w.needs_logits and w.req.params.greedy for w in plan):
            greedy = greedy_rows(logits)
        out: list[int | BaseException | None] = []
        for w, span in zip(plan, spans, strict=True):
            try:  # this request's values: a failure here is its own
                out.append(self._book(w, logits, span, greedy))
            except Exception as e:
                out.append(e)
        return out

    def _book(self, w: Work[Request], logits: torch.Tensor, span: range,
              greedy: list[int] | None) -> int | None:  # fmt: skip
        """The token sampled for `w` from its rows `span` of the step's logits (None: a prompt
        chunk, or a prompt-only request; `greedy`: every row's argmax, or None); the
        log-probabilities it asked for go to `self.logprobs`."""
        req, p = w.req, w.req.params
        lps: dict[str, object] = {}
        if req.wants_prompt_logits and req.num_computed < len(req.prompt_ids) - 1:
            # row i (position start + i) predicts the prompt token at start + i + 1
            start, n = req.num_computed, len(req.prompt_ids)
            nxt = req.prompt_ids[start + 1 : min(start + len(w.tokens), n - 1) + 1]
            lps["prompt"] = logprobs_of(logits[span.start : span.start + len(nxt)], nxt,
                                        p.prompt_logprobs)  # fmt: skip
        token = None
        if w.needs_logits and p.max_new_tokens > 0:
            last = span.stop - 1
            banned = ()
            if len(req.output_ids) < p.min_tokens:
                eos = self.tokenizer.eos_id
                banned = (*p.stop_token_ids, *(() if eos is None or p.ignore_eos else (eos,)))
            seen = req.tokens if p.repetition_penalty != 1.0 else ()
            if greedy is not None and p.greedy and not banned and not seen:
                token = greedy[last]  # what `sample` would pick: nothing changes the row
            else:
                token = sample(logits[last], p, req.gen, seen, banned)
            if p.logprobs is not None:
                lps["token"] = logprobs_of(logits[last : last + 1], [token], p.logprobs)[0]
        self.logprobs[id(w)] = lps
        return token
