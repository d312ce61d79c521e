"""docs/semantics.md#block-hashing: chained block hashes."""

import hashlib
import pickle

from kvtwin.sim.core.hashing import (
    BlockHasher,
    CoarseBlockHashes,
    HashIdPrompt,
    TokenPrompt,
    builtin_hash,
    none_hash,
    sha256_pickle,
)


def _hashes(prompt, n_tokens, algo=sha256_pickle, bs=16, outputs=()):
    out: list = []
    BlockHasher(algo, bs).extend(out, prompt, list(outputs), n_tokens)
    return out


def test_none_hash_is_vllms_seed_value():
    value = none_hash(sha256_pickle)
    assert value.hex().startswith("066b1e89") and value.hex().endswith("d71198")


def test_sha256_chain_is_byte_for_byte_vllms():
    toks = list(range(1000, 1040))
    hashes = _hashes(TokenPrompt(toks), 40)
    parent = none_hash(sha256_pickle)
    for i in range(2):
        expected = hashlib.sha256(pickle.dumps((parent, tuple(toks[16 * i:16 * i + 16]), None),
                                               protocol=pickle.HIGHEST_PROTOCOL)).digest()
        assert hashes[i] == expected
        parent = expected


def test_only_full_blocks_are_hashed_and_outputs_complete_blocks():
    toks = list(range(20))
    assert len(_hashes(TokenPrompt(toks), 20)) == 1
    # 20 prompt + 12 outputs = 32 tokens: the second block now exists and mixes both.
    with_outputs = _hashes(TokenPrompt(toks), 32, outputs=range(500, 512))
    as_one_prompt = _hashes(TokenPrompt(toks + list(range(500, 512))), 32)
    assert with_outputs == as_one_prompt and len(with_outputs) == 2


def test_equal_hash_means_equal_prefix():
    a = _hashes(TokenPrompt(list(range(64))), 64, builtin_hash)
    b = _hashes(TokenPrompt(list(range(16)) + [7] * 16 + list(range(32, 64))), 64, builtin_hash)
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2] and a[3] != b[3]  # the chain carries the difference


def test_coarse_groups_reuse_the_last_fine_hash():
    fine = _hashes(TokenPrompt(list(range(100))), 100)  # 6 fine blocks of 16
    coarse = CoarseBlockHashes(fine, 2)  # blocks of 32
    assert len(coarse) == 3
    assert [coarse[i] for i in range(3)] == [fine[1], fine[3], fine[5]]


def test_hash_id_prompts_share_blocks_exactly_where_their_chunk_ids_agree():
    # 512-token chunks, block size 16: chunk 0 shared, chunk 1 differs.
    a = _hashes(HashIdPrompt([11, 12], 512, 1000), 1000, builtin_hash)
    b = _hashes(HashIdPrompt([11, 99], 512, 1000), 1000, builtin_hash)
    assert len(a) == 1000 // 16
    assert a[:32] == b[:32]
    assert all(x != y for x, y in zip(a[32:], b[32:]))


def test_both_hash_functions_give_the_same_equality_pattern():
    prompts = [list(range(64)), list(range(32)) + [1] * 32, list(range(64))]
    for fn in (sha256_pickle, builtin_hash):
        h = [_hashes(TokenPrompt(p), 64, fn) for p in prompts]
        assert h[0] == h[2] and h[0][:2] == h[1][:2] and h[0][2] != h[1][2]


def test_a_million_token_prompt_costs_one_hash_per_block_not_one_object_per_token():
    from kvtwin.sim.core.request import Request

    from .builders import engine, EchoModel, full

    hash_ids = list(range(1_000_000 // 512 + 1))
    eng = engine(full(), num_blocks=70_000, max_model_len=1_100_000, max_num_batched_tokens=1_100_000)
    first = Request("a", HashIdPrompt(hash_ids, 512, 1_000_000), 2)
    eng.add_request(first)
    assert len(first.block_hashes) == 1_000_000 // 16
    assert not hasattr(first.prompt, "token_ids")
    eng.step(EchoModel())
    eng.step(EchoModel())  # finished: its blocks stay cached
    second = Request("b", HashIdPrompt(hash_ids, 512, 1_000_000), 2)
    eng.add_request(second)
    out = eng.step(EchoModel()).output
    assert out.scheduled_new_reqs[0].hit_tokens == 1_000_000 - 16  # all but the block holding the last token
