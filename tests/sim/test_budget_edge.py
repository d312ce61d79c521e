"""The token budget's edge with chunked prefill off.

vLLM 0.33 (``v1/core/sched/scheduler.py``, the waiting loop) stops admitting when
``not enable_chunked_prefill and num_new_tokens > token_budget``: a prompt whose tokens
exactly fill what is left of ``max_num_batched_tokens`` is admitted whole; one token more
and admission stops (the prompt is never chunked). Recomputed here from the budget by
hand: what the first request leaves is ``budget - len(first prompt)``.
"""

from __future__ import annotations

import pytest

from tests.sim.builders import EchoModel, engine, full, new_request, tokens

BUDGET = 256
FIRST = 100


@pytest.mark.parametrize("second, admitted", [
    (BUDGET - FIRST - 1, True),   # fits with a token to spare
    (BUDGET - FIRST, True),       # exactly fills the budget: vLLM admits it (">", not ">=")
    (BUDGET - FIRST + 1, False),  # one token over: refused, not chunked
])
def test_a_prompt_that_exactly_fills_the_remaining_budget_is_admitted(second, admitted):
    eng = engine(full(), num_blocks=128, max_num_batched_tokens=BUDGET, max_model_len=BUDGET,
                 enable_chunked_prefill=False)
    eng.add_request(new_request("a", tokens(0, FIRST)))
    eng.add_request(new_request("b", tokens(10_000, second)))
    out = eng.step(EchoModel()).output
    expected = {"a": FIRST, "b": second} if admitted else {"a": FIRST}
    assert out.num_scheduled_tokens == expected
    assert out.total_num_scheduled_tokens == sum(expected.values()) <= BUDGET

