"""Default acceptance tables of the speculative-decoding methods, with their sources.

docs/semantics.md#speculative-decoding. A table gives the probability that draft ``i``
(0-based) is accepted given drafts ``0 .. i-1`` were (``sim/scenario/acceptance.py``). Published
figures are mostly mean acceptance lengths ``tau`` (tokens per verify step, the bonus token
included) measured with ``K`` drafts; where no per-position figure was found the rate is
the constant ``alpha`` that gives that ``tau``: ``tau = (1 - alpha**(K + 1)) / (1 - alpha)``.
A table shorter than ``num_speculative_tokens`` repeats its last rate. These are chain
drafts (vLLM's, top-1 per position), single-batch chat workloads at temperature 1: a
different workload or draft head can accept much more or less, so a scenario that knows
its own rates should give ``acceptance``.
"""

from __future__ import annotations

# method -> (per-position rates, source)
DEFAULT_ACCEPTANCE: dict[str, tuple[tuple[float, ...], str]] = {
    # EAGLE-3 head yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: tau = 2.77 on MT-bench with K = 7 at
    # temperature 1 (measured with rejection sampling; nebius/EAGLE3-Llama-3.3-70B-Instruct
    # model card, "Comparison with Public Checkpoints"); HumanEval 3.49, GSM8K 3.34. The
    # constant alpha = 0.65 gives tau = 2.77 at K = 7. (The EAGLE-3 paper, arXiv 2503.01840,
    # reports longer acceptance with tree drafts, which vLLM's chain drafts do not use.)
    "eagle3": ((0.65,), "EAGLE-3 head for Llama-3.1-8B, tau 2.77 at K=7 (MT-bench, T=1; nebius model "
                        "card): constant 0.65"),
    # EAGLE(-1/-2) heads: no per-position figure for Llama-3.1-8B was at hand. The EAGLE-3
    # paper reports EAGLE-3 about 1.3-1.4x EAGLE-2's acceptance length; tau = 2.77 / 1.3 = 2.13
    # at K = 7 gives alpha = 0.535. An estimate: give acceptance for a known head.
    "eagle": ((0.535,), "estimate: EAGLE-3's tau / 1.3 (arXiv 2503.01840) at K=7: constant 0.535"),
    # DeepSeek-V3's MTP module: the second token (the first draft) is accepted 85-90% of the
    # time (DeepSeek-V3 technical report, arXiv 2412.19437, section 5.4.3): 0.875. Reused
    # autoregressively for later drafts it reaches tau = 3.09 at K = 7, temperature 1
    # (nebius/MTP-DeepSeek-V3-0324 model card, "Original MTP"): with 0.875 first, a
    # constant 0.593 for the later positions gives that tau.
    "mtp": ((0.875, 0.593), "arXiv 2412.19437 (85-90% for the first draft) and tau 3.09 at K=7 (nebius "
                            "model card): 0.875 then 0.593"),
}
# n-gram (prompt lookup) acceptance is a property of the workload (how much of the output
# repeats the prompt), not of a model: no default; a scenario must give ``acceptance``.


def default_acceptance(method: str, num_speculative_tokens: int) -> tuple[float, ...] | None:
    """The method's default per-position table for ``num_speculative_tokens`` drafts; None
    where the method has none (n-gram)."""
    entry = DEFAULT_ACCEPTANCE.get(method)
    if entry is None:
        return None
    rates = entry[0]
    return tuple(rates[min(i, len(rates) - 1)] for i in range(num_speculative_tokens))
