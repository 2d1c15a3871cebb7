"""llm.batch: Batch construction, the allocator's validation and filling, ubatch splits."""
from __future__ import annotations

import numpy as np
import pytest

from llm.batch import POS_MAX, Batch, BatchAllocator, BatchError, UBatch, ubatch_reserve


class FakeMemory:
    """Cached position ranges per sequence, as the KV cache reports them."""

    def __init__(self, ranges: dict[int, tuple[int, int]]):
        self.ranges = ranges

    def seq_pos_min(self, s: int) -> int:
        return self.ranges.get(s, (-1, -1))[0]

    def seq_pos_max(self, s: int) -> int:
        return self.ranges.get(s, (-1, -1))[1]


def _init(batch: Batch, *, n_seq_max: int = 4, memory=None, output_all: bool = False,
          n_vocab: int = 100, n_embd: int = 8) -> BatchAllocator:
    balloc = BatchAllocator()
    balloc.init(batch, n_vocab=n_vocab, n_embd=n_embd, n_seq_max=n_seq_max, memory=memory,
                output_all=output_all)
    return balloc


# --- Batch ---

def test_batch_fields():
    b = Batch(tokens=[5, 6, 7], pos=[3, 4, 5], seq_id=[0, [1, 2], (3,)], logits=[0, 1, 1])
    assert b.n_tokens == 3 and b.token.dtype == np.int32 and b.embd is None
    assert b.pos.tolist() == [3, 4, 5]
    assert b.seq_id == ((0,), (1, 2), (3,))
    assert b.logits.tolist() == [False, True, True]
    assert Batch(tokens=[1, 2], seq_id=np.array([[0, 1], [0, 1]])).seq_id == ((0, 1), (0, 1))
    e = Batch(embd=np.ones((2, 8)))
    assert e.n_tokens == 2 and e.embd.dtype == np.float32 and e.token is None
    one = Batch.get_one([1, 2, 3])
    assert one.pos is None and one.seq_id is None and one.logits is None
    assert Batch.get_one([]).n_tokens == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one of tokens or embd"),
    (dict(tokens=[1], embd=np.ones((1, 4))), "exactly one of tokens or embd"),
    (dict(tokens=[[1, 2]]), "tokens must be a 1-D sequence of integers"),
    (dict(tokens=[1.5]), "tokens must be a 1-D sequence of integers"),
    (dict(tokens=[2**40]), "tokens has values outside int32"),
    (dict(embd=np.ones(4)), r"embd must be 2-D"),
    (dict(tokens=[1, 2], pos=[0]), "pos has 1 entries, the batch has 2 tokens"),
    (dict(tokens=[1, 2], logits=[1, 0, 1]), "logits has 3 entries"),
    (dict(tokens=[1, 2], seq_id=[0]), "seq_id has 1 entries"),
    (dict(tokens=[1, 2], seq_id=[0, []]), r"seq_id\[1\] is empty"),
    (dict(tokens=[1, 2], seq_id=[0, [1, 1]]), r"seq_id\[1\] = \[1, 1\] lists a sequence twice"),
    (dict(tokens=[1, 2], seq_id=[0, [1, 0.5]]), r"seq_id\[1\]\[1\] = 0.5 is not an integer"),
])
def test_batch_rejects_malformed_fields(kwargs, match):
    with pytest.raises(BatchError, match=match):
        Batch(**kwargs)


# --- init: filling ---

def test_get_one_without_memory():
    balloc = _init(Batch.get_one([4, 5, 6]))
    assert balloc.pos.tolist() == [0, 1, 2]
    assert balloc.seq_id == ((0,), (0,), (0,))
    assert balloc.output.tolist() == [False, False, True]
    assert balloc.n_outputs == 1 and balloc.output_ids.tolist() == [-1, -1, 0]
    assert (balloc.seq_pos_min(0), balloc.seq_pos_max(0), balloc.seq_pos_max(1)) == (0, 2, -1)


def test_positions_continue_the_memory():
    memory = FakeMemory({0: (0, 4), 1: (0, 9)})
    balloc = _init(Batch(tokens=[1, 2, 3, 4], seq_id=[0, 1, 0, 2]), memory=memory)
    assert balloc.pos.tolist() == [5, 10, 6, 0]


def test_positions_with_shared_tokens():
    # a token in several sequences takes its first sequence's next position and advances all
    balloc = _init(Batch(tokens=[1, 2, 3], seq_id=[[0, 1], 0, 1]))
    assert balloc.pos.tolist() == [0, 1, 1]
    assert balloc.seq_set.tolist() == [3, 1, 2]
    assert balloc.seq_id_unq.tolist() == [0, 1]


def test_output_flags():
    assert _init(Batch.get_one([1, 2]), output_all=True).output.tolist() == [True, True]
    b = Batch(tokens=[1, 2, 3], logits=[1, 0, 1])
    balloc = _init(b)
    assert balloc.output.tolist() == [True, False, True] and balloc.n_outputs == 2
    assert balloc.output_ids.tolist() == [0, -1, 1]
    # embeddings need every token: output_all overrides the caller's flags
    assert _init(b, output_all=True).output.tolist() == [True, True, True]
    assert _init(Batch(tokens=[1, 2], logits=[0, 0])).n_outputs == 0


# --- init: validation ---

@pytest.mark.parametrize("batch, match", [
    (Batch.get_one([]), "the batch is empty"),
    (Batch.get_one([1, 100, 2]), r"token\[1\] = 100 is out of range \[0, n_vocab = 100\)"),
    (Batch.get_one([1, -3]), r"token\[1\] = -3 is out of range"),
    (Batch(tokens=[1, 2], seq_id=[0, [1, 4]]), r"seq_id\[1\]\[1\] = 4 is out of range \[0, n_seq_max = 4\)"),
    (Batch(tokens=[1, 2], seq_id=[-1, 0]), r"seq_id\[0\]\[0\] = -1 is out of range"),
    (Batch(tokens=[1, 2], pos=[0, -1]), r"pos\[1\] = -1 is negative"),
    (Batch(tokens=[1, 2, 3], pos=[0, 1, 3]), "sequence 0: positions are not continuous"),
    (Batch(tokens=[1, 2], pos=[1, 0]), r"sequence 0: positions decrease \(1 then 0\)"),
    (Batch(embd=np.ones((2, 5))), "embd has 5 values per token, the model's n_embd is 8"),
])
def test_invalid_batches(batch, match):
    with pytest.raises(BatchError, match=match):
        _init(batch)


def test_positions_must_continue_the_cache():
    memory = FakeMemory({0: (0, 4)})
    with pytest.raises(BatchError, match="sequence 0: the cache holds positions up to 4, so the "
                                         "batch must continue at 5, but it starts at 7"):
        _init(Batch(tokens=[1, 2], pos=[7, 8]), memory=memory)
    with pytest.raises(BatchError, match="starts at 3"):
        _init(Batch(tokens=[1, 2], pos=[3, 4]), memory=memory)
    assert _init(Batch(tokens=[1, 2], pos=[5, 6]), memory=memory).pos.tolist() == [5, 6]
    # a sequence absent from the cache may start anywhere
    assert _init(Batch(tokens=[1], pos=[7], seq_id=[1]), memory=memory).pos.tolist() == [7]


def test_coupled_sequences_must_agree_in_the_cache():
    batch = Batch(tokens=[1], seq_id=[[0, 1]], pos=[5])
    with pytest.raises(BatchError, match="sequence 1 is coupled to sequence 0"):
        _init(batch, memory=FakeMemory({0: (0, 4), 1: (2, 4)}))
    assert _init(batch, memory=FakeMemory({0: (0, 4), 1: (0, 4)})).pos.tolist() == [5]


def test_positions_must_leave_room_for_the_next_one():
    """pos 2**31 - 1 would make the next position overflow int32: rejected like any bad field."""
    assert POS_MAX == 2**31 - 2
    assert _init(Batch(tokens=[1], pos=[POS_MAX])).pos.tolist() == [POS_MAX]
    with pytest.raises(BatchError, match=rf"pos\[1\] = {POS_MAX + 1} is past POS_MAX"):
        _init(Batch(tokens=[1, 2], pos=[POS_MAX, POS_MAX + 1]))
    # a sequence that reached POS_MAX is full: its next token cannot be placed
    with pytest.raises(BatchError, match=rf"pos\[0\] = {POS_MAX + 1} \(continuing sequence 2\) is past"):
        _init(Batch(tokens=[1], seq_id=[2]), memory=FakeMemory({2: (POS_MAX - 3, POS_MAX)}))
    with pytest.raises(BatchError, match="pos has values outside int32"):
        Batch(tokens=[1], pos=[2**40])


def test_failed_init_keeps_nothing():
    balloc = _init(Batch.get_one([1, 2, 3]))
    with pytest.raises(BatchError):
        balloc.init(Batch.get_one([1, 999]), n_vocab=100, n_embd=8, n_seq_max=4)
    assert balloc.n_tokens == 3 and balloc.pos.tolist() == [0, 1, 2]


def test_n_seq_max_limit():
    with pytest.raises(ValueError, match="n_seq_max = 65"):
        _init(Batch.get_one([1]), n_seq_max=65)


# --- splits ---

def _check_covers(balloc: BatchAllocator, ubatches: list[UBatch], n_ubatch: int) -> None:
    idxs = np.concatenate([u.idxs for u in ubatches])
    assert sorted(idxs.tolist()) == list(range(balloc.n_tokens))
    assert balloc.n_used == balloc.n_tokens
    for u in ubatches:
        assert 1 <= u.n_tokens <= n_ubatch and u.n_tokens == u.n_seqs * u.n_seq_tokens
        assert u.pos.tolist() == balloc.pos[u.idxs].tolist()
        assert u.token.tolist() == balloc.token[u.idxs].tolist()
        assert u.seq_id == tuple(balloc.seq_id[i] for i in u.idxs)
    assert balloc.out_ids.tolist() == [i for u in ubatches for i in u.idxs[u.output]]


def test_split_simple():
    balloc = _init(Batch(tokens=list(range(7)), logits=[0, 1, 0, 0, 1, 0, 1]))
    ubatches = balloc.split_simple(3)
    assert [u.idxs.tolist() for u in ubatches] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [(u.n_seqs, u.n_seq_tokens, u.equal_seqs) for u in ubatches] == \
        [(3, 1, False), (3, 1, False), (1, 1, False)]
    assert [u.n_outputs for u in ubatches] == [1, 1, 1]
    _check_covers(balloc, ubatches, 3)
    assert [balloc.output_rows(u).tolist() for u in ubatches] == [[0], [1], [2]]
    # splitting again starts over
    assert len(balloc.split_simple(7)) == 1 and balloc.n_used == 7


def test_split_equal_two_sequences():
    # seq 0 at batch indices 0, 2, 4; seq 1 at 1, 3, 5, 6, 7
    balloc = _init(Batch(tokens=list(range(8)), seq_id=[0, 1, 0, 1, 0, 1, 1, 1],
                         pos=[0, 0, 1, 1, 2, 2, 3, 4], logits=[1] * 8))
    ubatches = balloc.split_equal(4)
    assert [u.idxs.tolist() for u in ubatches] == [[0, 2, 1, 3], [4, 5], [6, 7]]
    assert [(u.n_seqs, u.n_seq_tokens) for u in ubatches] == [(2, 2), (2, 1), (1, 2)]
    assert [u.seq_id_unq.tolist() for u in ubatches] == [[0, 1], [0, 1], [1]]
    assert all(u.equal_seqs for u in ubatches)
    _check_covers(balloc, ubatches, 4)
    # outputs come out in ubatch order; output_rows puts them back in batch order
    assert balloc.out_ids.tolist() == [0, 2, 1, 3, 4, 5, 6, 7]
    rows = np.concatenate([balloc.output_rows(u) for u in ubatches])
    assert rows.tolist() == [0, 2, 1, 3, 4, 5, 6, 7]


def test_split_equal_shared_prompt_gets_its_own_ubatch():
    balloc = _init(Batch(tokens=[1, 2, 3, 4, 5], seq_id=[0, 1, 0, 1, [0, 1]],
                         pos=[0, 0, 1, 1, 2]))
    ubatches = balloc.split_equal(4)
    assert [u.idxs.tolist() for u in ubatches] == [[0, 2, 1, 3], [4]]
    assert ubatches[1].seq_id == ((0, 1),) and ubatches[1].seq_id_unq.tolist() == [0, 1]
    _check_covers(balloc, ubatches, 4)


def test_split_equal_never_exceeds_n_ubatch():
    balloc = _init(Batch(tokens=list(range(10)), seq_id=[0, 1, 2, 3, 4] * 2,
                         pos=[0] * 5 + [1] * 5), n_seq_max=5)
    ubatches = balloc.split_equal(3)
    # each ubatch takes the first 3 disjoint sequence sets among the unused tokens
    assert [u.idxs.tolist() for u in ubatches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [u.seq_id_unq.tolist() for u in ubatches] == [[0, 1, 2], [0, 3, 4], [1, 2, 3], [4]]
    _check_covers(balloc, ubatches, 3)


def test_split_seq():
    balloc = _init(Batch(tokens=[1, 2, 3, 4, 5], seq_id=[[0, 1], 0, 1, 0, 1],
                         pos=[0, 1, 1, 2, 2]))
    ubatches = balloc.split_seq(8)
    # from a {0, 1} token, following tokens of a subset set join, and narrow the set
    assert [u.idxs.tolist() for u in ubatches] == [[0, 1, 3], [2, 4]]
    assert [(u.n_seqs, u.n_seq_tokens) for u in ubatches] == [(1, 3), (1, 2)]
    _check_covers(balloc, ubatches, 8)
    assert [u.idxs.tolist() for u in balloc.split_seq(2)] == [[0, 1], [2, 4], [3]]


def test_split_embeddings_carry_rows():
    embd = np.arange(24, dtype=np.float32).reshape(3, 8)
    balloc = _init(Batch(embd=embd))
    ubatches = balloc.split_simple(2)
    assert ubatches[0].token is None
    assert np.array_equal(ubatches[1].embd, embd[2:])


def test_split_arguments():
    balloc = BatchAllocator()
    with pytest.raises(ValueError, match="before a successful init"):
        balloc.split_simple(4)
    balloc = _init(Batch.get_one([1]))
    with pytest.raises(ValueError, match="n_ubatch = 0"):
        balloc.split_equal(0)


def test_ubatch_reserve():
    u = ubatch_reserve(n_seq_tokens=3, n_seqs=2)
    assert (u.n_tokens, u.n_seqs, u.n_seq_tokens, u.n_outputs) == (6, 2, 3, 0)
    assert u.seq_id == ((0,),) * 3 + ((1,),) * 3
    assert u.seq_set.tolist() == [1, 1, 1, 2, 2, 2] and u.seq_id_unq.tolist() == [0, 1]


# --- M-RoPE positions ---

def test_mrope_positions_of_an_image():
    """An M-RoPE model's image embeddings carry [4, n] positions (t, y, x, e): the t of all its
    tokens is the image's first position, the next batch may start there again (embeddings)
    or jump forward (the image took max(nx, ny) positions), never back."""
    grid = np.array([[5, 5, 5, 5], [5, 5, 6, 6], [5, 6, 5, 6], [0, 0, 0, 0]])
    balloc = BatchAllocator()
    balloc.init(Batch(embd=np.zeros((4, 8)), pos=grid), n_vocab=100, n_embd=8, n_seq_max=1,
                memory=FakeMemory({0: (0, 4)}), mrope=True)
    assert balloc.pos.tolist() == [5, 5, 5, 5]
    ubs = balloc.split_simple(3)
    assert ubs[0].pos_sections.tolist() == grid[:, :3].tolist() and ubs[1].pos_sections.tolist() == grid[:, 3:].tolist()
    again = Batch(embd=np.zeros((1, 8)), pos=[[5], [6], [6], [0]])
    balloc.init(again, n_vocab=100, n_embd=8, n_seq_max=1, memory=FakeMemory({0: (0, 5)}), mrope=True)
    balloc.init(Batch(tokens=[1], pos=[7]), n_vocab=100, n_embd=8, n_seq_max=1, memory=FakeMemory({0: (0, 5)}),
                mrope=True)
    with pytest.raises(BatchError, match="the batch's tokens must start at 6 or later"):
        balloc.init(Batch(tokens=[1], pos=[5]), n_vocab=100, n_embd=8, n_seq_max=1, memory=FakeMemory({0: (0, 5)}),
                    mrope=True)
    with pytest.raises(BatchError, match="M-RoPE sections, but the model takes one position per token"):
        _init(Batch(embd=np.zeros((4, 8)), pos=grid))
    with pytest.raises(BatchError, match="2-D positions .* go with embd"):
        Batch(tokens=[1, 2, 3, 4], pos=grid)
    with pytest.raises(BatchError, match="pos has 3 rows"):
        Batch(embd=np.zeros((4, 8)), pos=grid[:3])
