"""What the project's oracle harnesses share: the environment vLLM needs before it is
imported (offline, caches under the temporary directory, warnings off), the stand-in model
config that lets vLLM build a ``ModelConfig`` without weights, and the case files' readers
and writers (written whole or not at all).

Standard library only: a harness imports this first, calls ``prepare_environment``, and
only then imports torch and vLLM.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
GOLDEN_CASES = os.path.join(REPO, "tests", "golden", "cases")

# A model config only (no weights): vLLM needs one to build ModelConfig. The scheduler
# never looks at it; the KV cache groups are given directly.
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 65536, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}


class CaseError(Exception):
    pass


def prepare_environment(name: str) -> str:
    """Offline, with vLLM's and Hugging Face's caches under ``<tmp>/<name>``; returns that
    directory. Call before importing torch or vLLM."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    cache = os.path.join(tempfile.gettempdir(), name)
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(cache, "vllm"))
    os.environ.setdefault("HF_HOME", os.path.join(cache, "huggingface"))
    return cache


def tiny_model_dir(cache: str) -> str:
    """A directory holding ``TINY_MODEL`` as ``config.json`` (rewritten only if it differs)."""
    d = os.path.join(cache, "tiny_model")
    path = os.path.join(d, "config.json")
    want = json.dumps(TINY_MODEL, sort_keys=True)
    try:
        with open(path) as f:
            if f.read() == want:
                return d
    except OSError:
        pass
    os.makedirs(d, exist_ok=True)
    atomic_write(path, want)
    return d


def read_jsonl(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise CaseError(f"{path}:{n}: bad JSON ({e})") from None
    return out


def atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_jsonl(path: str, rows: list[dict]) -> None:
    atomic_write(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def write_json(path: str, obj: dict) -> None:
    atomic_write(path, json.dumps(obj, indent=1) + "\n")


def accept_script(rng, k: int, rate: float, n: int) -> list[int]:
    """Drafts a scripted model accepts at each of ``n`` verify steps (speculative cases): at
    each of the ``k`` positions with probability ``rate``, the first rejection ending the run."""
    out = []
    for _ in range(n):
        accepted = 0
        while accepted < k and rng.random() < rate:
            accepted += 1
        out.append(accepted)
    return out
