"""Backend selection (KVTWIN_ATTN_BACKEND, fallback with reasons) and the vllm_flash_attn
adapter, driven on CPU by stand-ins that follow the two flash-attention APIs."""

import sys
import types

import pytest

torch = pytest.importorskip("torch")

from kvtwin import kernels  # noqa: E402
from kvtwin.kernels import backends, cases, flash, reference  # noqa: E402


def test_auto_on_cpu_is_the_reference(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    backend = backends.select_backend("cpu")
    assert backend.name == "torch" and backend.paged_attention is reference.paged_attention
    assert backends.select_backend("cpu") is backend  # the choice is cached


def test_forced_triton_runs_under_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    assert backends.select_backend("cpu").name == "triton"
    case = cases.attention_case([3, 1], [20, 9], block_size=8)
    kernels.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    got = kernels.paged_attention(**case.attention_args())
    torch.testing.assert_close(got, reference.paged_attention(**case.attention_args()), atol=2e-5, rtol=2e-5)


def test_forced_backend_that_cannot_run_is_an_error(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(backends.BackendUnavailable, match="TRITON_INTERPRET=1"):
        backends.select_backend("cpu")
    monkeypatch.setenv(backends.ENV_VAR, "vllm_flash_attn")
    with pytest.raises(backends.BackendUnavailable, match="needs a CUDA device"):
        backends.select_backend("cpu")


def test_unknown_backend_name_is_an_error(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "cutlass")
    with pytest.raises(backends.BackendUnavailable, match="expected one of auto, vllm_flash_attn, triton, torch"):
        backends.select_backend("cpu")


def test_auto_on_gpu_falls_back_with_the_reason(monkeypatch):
    """On CUDA, auto prefers flash, then Triton, then torch, keeping why it skipped one."""
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setattr(backends, "flash_problem", lambda device_type: "disagrees on a tiny case")
    monkeypatch.setattr(backends, "triton_problem", lambda device_type: None)
    backend = backends.resolve("auto", "cuda")
    assert backend.name == "triton"
    assert "vllm_flash_attn: disagrees on a tiny case" in backend.note
    backends.resolve.cache_clear()
    monkeypatch.setattr(backends, "triton_problem", lambda device_type: "no driver")
    backend = backends.resolve("auto", "cuda")
    assert backend.name == "torch" and "triton: no driver" in backend.note


def test_availability_names_every_backend():
    report = {a.name: a for a in backends.availability("cpu")}
    assert set(report) == {"torch", "triton", "vllm_flash_attn"}
    assert report["torch"].usable
    assert not report["vllm_flash_attn"].usable and "CUDA" in report["vllm_flash_attn"].detail


# ---------------------------------------------------------------------------------------
# The flash adapter, against stand-ins with each API's argument order and names
# ---------------------------------------------------------------------------------------


def _from_flash_window(window_size):
    if window_size is None or window_size[0] < 0:
        return None
    assert window_size[1] == 0, "causal attention has no right window"
    return window_size[0] + 1


def vllm_style(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None, q_v=None,
               dropout_p=0.0, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
               return_softmax_lse=False, out=None, fa_version=2):
    """vllm.vllm_flash_attn's order: max_seqlen_q before cu_seqlens_q; paged lengths in seqused_k."""
    assert causal and cu_seqlens_k is None and block_table.dtype == torch.int32
    assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    assert max_seqlen_k == int(seqused_k.max())
    return reference.paged_attention(q, k, v, block_table, seqused_k, cu_seqlens_q, softmax_scale,
                                     sliding_window=_from_flash_window(window_size))


def standalone_style(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     deterministic=False, return_attn_probs=False, block_table=None):
    """Older standalone order: both cumulative lengths first; key lengths as cu_seqlens_k."""
    assert causal
    seq_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    return reference.paged_attention(q, k, v, block_table, seq_lens, cu_seqlens_q, softmax_scale,
                                     sliding_window=_from_flash_window(window_size)), None


@pytest.mark.parametrize("varlen", [vllm_style, standalone_style])
@pytest.mark.parametrize("window,chunk", [(None, None), (13, None), (None, 16)])
def test_flash_adapter_calls_each_api_by_keyword(varlen, window, chunk):
    adapter = flash.FlashAttention(varlen, "stand-in")
    case = cases.attention_case([6, 1, 20], [37, 50, 20], block_size=8, sliding_window=window, chunk_size=chunk)
    reference.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    torch.testing.assert_close(adapter(**case.attention_args()), reference.paged_attention(**case.attention_args()))


def test_flash_check_catches_a_wrong_kernel():
    adapter = flash.FlashAttention(vllm_style, "stand-in")
    assert flash.check(adapter, reference.paged_attention, "cpu") is None
    wrong = lambda **case: reference.paged_attention(**case) * 1.01  # noqa: E731
    assert "max abs error" in flash.check(wrong, reference.paged_attention, "cpu")
    assert "failed on a tiny case" in flash.check(lambda **case: 1 / 0, reference.paged_attention, "cpu")


def test_flash_load_prefers_vllm_and_reports_every_failure(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # no vLLM here
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", types.SimpleNamespace(flash_attn_varlen_func=standalone_style))
    assert flash.load().module_name == "vllm_flash_attn"
    monkeypatch.setitem(sys.modules, "vllm_flash_attn",
                        types.SimpleNamespace(flash_attn_varlen_func=lambda q, k, v, cu_seqlens_q: q))
    with pytest.raises(flash.FlashUnavailable) as err:
        flash.load()
    assert "vllm.vllm_flash_attn" in str(err.value) and "no block_table" in str(err.value)
