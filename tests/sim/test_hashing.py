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


# -- lookahead block hashes (docs/semantics.md#draft-heads-and-prefix-caching) ----------

def _lookahead_hashes(prompt, n_tokens, algo=sha256_pickle, bs=16, outputs=(), lookahead=1):
    out: list = []
    BlockHasher(algo, bs, lookahead).extend(out, prompt, list(outputs), n_tokens)
    return out


def test_lookahead_hash_is_vllms_block_tokens_with_the_next_token_as_extra_keys():
    toks = list(range(2000, 2040))
    hashes = _lookahead_hashes(TokenPrompt(toks), 40)
    parent = none_hash(sha256_pickle)
    assert len(hashes) == 2
    for i in range(2):
        block = tuple(toks[16 * i:16 * i + 16])
        expected = hashlib.sha256(pickle.dumps((parent, block, (None, toks[16 * i + 16])),
                                               protocol=pickle.HIGHEST_PROTOCOL)).digest()
        assert hashes[i] == expected
        parent = expected


def test_a_block_gets_its_lookahead_hash_only_once_the_token_after_it_exists():
    toks = list(range(32))
    assert len(_lookahead_hashes(TokenPrompt(toks), 32)) == 1  # block 1's next token unknown
    with_output = _lookahead_hashes(TokenPrompt(toks), 33, outputs=[7])
    assert len(with_output) == 2
    # The request's own counter asks for the next hash one token later too.
    from kvtwin.sim.core.request import Request
    req = Request("r", TokenPrompt(toks), 4)
    req.attach_hasher(BlockHasher(sha256_pickle, 16, 1))
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([7])
    assert req.block_hashes == with_output


def test_lookahead_hashes_differ_where_the_token_after_a_block_differs():
    base = list(range(100, 132))
    a = _lookahead_hashes(TokenPrompt(base + [1, 2]), 34)
    b = _lookahead_hashes(TokenPrompt(base + [9, 2]), 34)
    assert a[0] == b[0] and a[1] != b[1]
    # Plain hashes do not see the token after the block.
    assert _hashes(TokenPrompt(base + [1, 2]), 34)[1] == _hashes(TokenPrompt(base + [9, 2]), 34)[1]


def test_hash_id_prompts_with_lookahead_need_and_name_the_next_tokens():
    hasher = BlockHasher(builtin_hash, 16, 1)
    same_a = HashIdPrompt([11, 12, 13], 16, 48)
    same_b = HashIdPrompt([11, 12, 14], 16, 48)
    ha, hb = hasher.new_hashes(same_a), hasher.new_hashes(same_b)
    # Block 1's next token is in chunk 2, where the prompts differ; block 2 waits for an output.
    assert len(ha) == 2 and ha[0] == hb[0] and ha[1] != hb[1]
    assert ha.range(0, 2) == [ha[0], ha[1]]
    hasher.extend(ha, same_a, [5], 49)
    assert len(ha) == 3
    slow = BlockHasher(sha256_pickle, 16, 1).new_hashes(same_a)
    assert len(slow) == 2
