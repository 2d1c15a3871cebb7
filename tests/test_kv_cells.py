"""llm.kv_cells: slot finding, all-or-nothing prepare, sequence ops, masks (hand-worked cases)."""
from __future__ import annotations

import numpy as np
import pytest

from llm.batch import POS_MAX, Batch, BatchAllocator, BatchError, UBatch
from llm.hparams import SWAType
from llm.kv_cells import KVCells, SlotInfo

X = -np.inf


def _ub(pos, seq_id=None) -> UBatch:
    """One ubatch holding tokens at `pos` (sequence 0 unless seq_id says otherwise)."""
    balloc = BatchAllocator()
    balloc.init(Batch(tokens=[0] * len(pos), pos=pos, seq_id=seq_id), n_vocab=1, n_embd=1,
                n_seq_max=4)
    return balloc.split_simple(len(pos))[0]


def _put(cells: KVCells, pos, seq_id=None) -> SlotInfo:
    ub = _ub(pos, seq_id)
    slot = cells.find_slot(ub)
    assert slot is not None
    cells.apply(slot, ub)
    return slot


def _state(cells: KVCells):
    return cells.pos.tolist(), cells.seq.tolist(), cells.shift.tolist(), cells.head, cells.has_shift


def test_empty_cache():
    cells = KVCells(1024, 2)
    assert (cells.get_used(), cells.used_max_p1()) == (0, 0)
    assert (cells.seq_pos_min(1), cells.seq_pos_max(1)) == (-1, -1)
    assert cells.n_kv() == 256 and cells.n_kv(bucket=64) == 64
    assert KVCells(100, 1).n_kv() == 100


def test_find_slot_then_apply_fills_in_order():
    cells = KVCells(16, 1)
    ub = _ub([0, 1, 2])
    slot = cells.find_slot(ub)
    assert slot.idxs.tolist() == [0, 1, 2]
    assert cells.get_used() == 0  # finding does not modify
    cells.apply(slot, ub)
    assert cells.pos[:4].tolist() == [0, 1, 2, -1] and cells.seq[:3].tolist() == [1, 1, 1]
    assert (cells.head, cells.get_used(), cells.used_max_p1()) == (3, 3, 3)
    assert (cells.seq_pos_min(0), cells.seq_pos_max(0)) == (0, 2)
    assert _put(cells, [3, 4]).idxs.tolist() == [3, 4]


def test_n_kv_rounds_up_to_the_bucket():
    cells = KVCells(1024, 1)
    _put(cells, list(range(300)))
    assert cells.n_kv(256) == 512 and cells.n_kv(100) == 300 and cells.n_kv(1024) == 1024
    cells = KVCells(1000, 1)
    _put(cells, list(range(900)))
    assert cells.n_kv(256) == 1000  # never past n_ctx
    with pytest.raises(ValueError, match="bucket = 0"):
        cells.n_kv(0)


def test_find_slot_fills_holes():
    cells = KVCells(16, 1)
    _put(cells, list(range(10)))
    cells.seq_rm(0, 3, 6)
    assert cells.pos[:11].tolist() == [0, 1, 2, -1, -1, -1, 6, 7, 8, 9, -1]
    assert cells.head == 3  # search restarts at the first freed cell
    assert cells.find_slot(_ub([10, 11])).idxs.tolist() == [3, 4]
    assert cells.find_slot(_ub([10, 11, 12, 13])).idxs.tolist() == [3, 4, 5, 10]
    assert cells.find_slot(_ub([10, 11, 12, 13]), cont=True).idxs.tolist() == [10, 11, 12, 13]
    assert cells.find_slot(_ub([10, 11, 12]), cont=True).idxs.tolist() == [3, 4, 5]


def test_find_slot_head_rules():
    cells = KVCells(8, 1)
    _put(cells, [0, 1])
    cells.head = 4          # head not far past the used cells: search from head
    assert cells.find_slot(_ub([2])).idxs.tolist() == [4]
    cells.head = 6          # 6 > used (2) + 2 * n_tokens (2): search from the start
    assert cells.find_slot(_ub([2])).idxs.tolist() == [2]
    cells.head = 6          # the search wraps around the end
    assert cells.find_slot(_ub([2, 3, 4])).idxs.tolist() == [6, 7, 2]
    assert cells.find_slot(_ub([2, 3, 4]), cont=True).idxs.tolist() == [2, 3, 4]


def test_no_room():
    cells = KVCells(8, 1)
    _put(cells, list(range(6)))
    assert cells.find_slot(_ub([6, 7, 8])) is None
    assert cells.find_slot(_ub(list(range(9)))) is None
    cells.seq_rm(0, 1, 2)
    cells.seq_rm(0, 3, 4)
    assert cells.head == 1
    assert cells.find_slot(_ub([6, 7, 8])).idxs.tolist() == [1, 3, 6]
    assert cells.find_slot(_ub([6, 7]), cont=True).idxs.tolist() == [6, 7]
    assert cells.find_slot(_ub([6, 7, 8]), cont=True) is None


def test_prepare_is_all_or_nothing():
    cells = KVCells(8, 1)
    _put(cells, list(range(6)))
    cells.seq_rm(0, 5, 6)
    before = _state(cells)
    assert cells.prepare([_ub([5, 6]), _ub([7, 8])]) is None
    assert _state(cells) == before
    slots = cells.prepare([_ub([5]), _ub([6, 7])])
    assert [s.idxs.tolist() for s in slots] == [[5], [6, 7]]
    assert _state(cells) == before


def test_prepare_places_ubatches_one_after_another():
    cells = KVCells(32, 1)
    balloc = BatchAllocator()
    balloc.init(Batch.get_one(list(range(20))), n_vocab=20, n_embd=1, n_seq_max=1, memory=cells)
    ubatches = balloc.split_simple(7)
    slots = cells.prepare(ubatches)
    assert [s.idxs.tolist() for s in slots] == [list(range(0, 7)), list(range(7, 14)),
                                                list(range(14, 20))]
    assert cells.get_used() == 0
    for slot, ub in zip(slots, ubatches, strict=False):
        cells.apply(slot, ub)
    assert cells.pos[:21].tolist() == list(range(20)) + [-1]


def _three_sequences() -> KVCells:
    """cells 0-1: shared prompt of seqs 0 and 1 (pos 0, 1); 2-3: seq 0 (pos 2, 3);
    4-6: seq 1 (pos 2, 3, 4)."""
    cells = KVCells(16, 3)
    _put(cells, [0, 1], [[0, 1], [0, 1]])
    _put(cells, [2, 3], [0, 0])
    _put(cells, [2, 3, 4], [1, 1, 1])
    assert cells.pos[:8].tolist() == [0, 1, 2, 3, 2, 3, 4, -1]
    assert cells.seq[:7].tolist() == [3, 3, 1, 1, 2, 2, 2]
    return cells


def test_seq_rm():
    cells = _three_sequences()
    assert cells.seq_rm(1, 3, -1)  # p1 < 0: to the end
    assert cells.pos[:7].tolist() == [0, 1, 2, 3, 2, -1, -1] and cells.seq_pos_max(1) == 2
    assert cells.head == 5
    cells.seq_rm(0, 0, 1)  # the shared cell stays, now only in sequence 1
    assert cells.seq[:2].tolist() == [2, 3] and cells.pos[0] == 0
    assert (cells.seq_pos_min(0), cells.seq_pos_min(1)) == (1, 0)
    cells.seq_rm(-1, 1, 3)  # every sequence, positions 1 and 2
    assert cells.pos[:7].tolist() == [0, -1, -1, 3, -1, -1, -1]
    assert cells.seq[:4].tolist() == [2, 0, 0, 1]
    assert cells.head == 1
    cells.seq_rm(-1)
    assert cells.get_used() == 0
    with pytest.raises(ValueError, match="seq_id = 3 is out of range"):
        cells.seq_rm(3)


def test_seq_cp_and_seq_keep():
    cells = KVCells(8, 3)
    _put(cells, [0, 1, 2, 3])
    cells.seq_cp(0, 1, 1, 3)
    assert cells.seq[:4].tolist() == [1, 3, 3, 1]
    assert (cells.seq_pos_min(1), cells.seq_pos_max(1)) == (1, 2)
    cells.seq_rm(0)
    assert cells.pos[:4].tolist() == [-1, 1, 2, -1] and cells.seq[:4].tolist() == [0, 2, 2, 0]
    cells.seq_cp(1, 2)
    assert cells.seq[1:3].tolist() == [6, 6]
    cells.seq_keep(2)
    assert cells.seq[1:3].tolist() == [4, 4] and cells.seq_pos_max(1) == -1
    assert _put(cells, [5], [0]).idxs.tolist() == [0]  # a cell of sequence 0 only
    cells.head = 6
    cells.seq_keep(2)
    assert cells.pos[:4].tolist() == [-1, 1, 2, -1] and cells.head == 0
    with pytest.raises(ValueError, match="seq_id_dst = 5"):
        cells.seq_cp(0, 5)


def test_seq_add_records_the_k_shift():
    cells = KVCells(8, 2)
    _put(cells, list(range(6)))
    _put(cells, [0], [1])  # cell 6, another sequence: not shifted
    cells.seq_add(0, 2, 4, 10)
    assert cells.pos[:7].tolist() == [0, 1, 12, 13, 4, 5, 0]
    assert cells.has_shift and cells.head == 0
    assert cells.k_shift().tolist() == [0, 0, 10, 10, 0, 0, 0, 0]
    cells.seq_add(0, 0, 2, -1)  # position 0 falls off: its cell becomes empty
    assert cells.pos[:2].tolist() == [-1, 0] and cells.seq[0] == 0 and cells.head == 0
    assert cells.k_shift().tolist() == [0, -1, 10, 10, 0, 0, 0, 0]
    assert (cells.seq_pos_min(0), cells.seq_pos_max(0)) == (0, 13)
    cells.reset_shift()
    assert not cells.has_shift and not cells.k_shift().any()
    before = _state(cells)
    cells.seq_add(0, 0, -1, 0)
    cells.seq_add(0, 3, 3, 5)
    assert _state(cells) == before


def test_seq_add_out_of_range_shifts():
    """A shift past int32 is a ValueError that changes nothing; a shift below 0 by any amount
    frees the cells (llama.cpp's rule), without overflowing the int32 bookkeeping."""
    cells = KVCells(8, 2)
    _put(cells, [0, 1, 2])
    before = _state(cells)
    for shift in (2**40, POS_MAX - 1):
        with pytest.raises(ValueError, match=rf"shift = {shift} moves position 2 of sequence 0 past POS_MAX"):
            cells.seq_add(0, 0, -1, shift)
        assert _state(cells) == before
    with pytest.raises(TypeError, match="shift must be an integer, got 1.5"):
        cells.seq_add(0, 0, -1, 1.5)
    cells.seq_add(0, 0, -1, POS_MAX - 2)     # the last position lands exactly on POS_MAX
    assert cells.pos[:3].tolist() == [POS_MAX - 2, POS_MAX - 1, POS_MAX]
    assert cells.k_shift()[:3].tolist() == [POS_MAX - 2] * 3
    cells.seq_add(0, 0, -1, -2**40)
    assert cells.get_used() == 0 and not cells.k_shift().any() and cells.head == 0
    cells.seq_rm(0, 2**40, 2**41)             # positions beyond int32 select nothing
    cells.seq_cp(0, 1, -2**40, 2**40)


def test_clear():
    cells = _three_sequences()
    cells.seq_add(0, 0, -1, 2)
    cells.clear()
    assert cells.get_used() == 0 and cells.head == 0 and not cells.has_shift
    assert not cells.seq.any() and not cells.k_shift().any()


# --- masks ---

def test_causal_mask_with_padding():
    cells = KVCells(8, 1)
    ub = _ub([0, 1, 2, 3])
    cells.apply(cells.find_slot(ub), ub)
    mask = cells.build_mask(ub, n_kv=6, n_tokens_pad=6)
    assert mask.dtype == np.float32
    np.testing.assert_array_equal(mask, [
        [0, X, X, X, X, X],
        [0, 0, X, X, X, X],
        [0, 0, 0, X, X, X],
        [0, 0, 0, 0, X, X],
        [0, X, X, X, X, X],   # padded rows see cell 0 only (no all -inf row, no NaN)
        [0, X, X, X, X, X],
    ])
    step = _ub([4])
    cells.apply(cells.find_slot(step), step)
    np.testing.assert_array_equal(cells.build_mask(step, n_kv=6), [[0, 0, 0, 0, 0, X]])
    np.testing.assert_array_equal(cells.build_mask(ub, n_kv=6, causal=False)[0],
                                  [0, 0, 0, 0, 0, X])


def test_mask_of_two_sequences():
    cells = KVCells(8, 2)
    _put(cells, [0, 1], [[0, 1], [0, 1]])  # shared prompt in cells 0, 1
    ub = _ub([2, 2, 3, 3], [0, 1, 0, 1])
    cells.apply(cells.find_slot(ub), ub)
    np.testing.assert_array_equal(cells.build_mask(ub, n_kv=8), [
        [0, 0, 0, X, X, X, X, X],
        [0, 0, X, 0, X, X, X, X],
        [0, 0, 0, X, 0, X, X, X],
        [0, 0, X, 0, X, 0, X, X],
    ])


def test_swa_mask_window_3():
    cells = KVCells(8, 1)
    ub = _ub([0, 1, 2, 3, 4])
    cells.apply(cells.find_slot(ub), ub)
    expected = [
        [0, X, X, X, X, X],
        [0, 0, X, X, X, X],
        [0, 0, 0, X, X, X],
        [X, 0, 0, 0, X, X],
        [X, X, 0, 0, 0, X],
    ]
    mask = cells.build_mask(ub, n_kv=6, swa_type=SWAType.STANDARD, n_swa=3)
    np.testing.assert_array_equal(mask, expected)
    swa_cells = KVCells(8, 1, swa_type=SWAType.STANDARD, n_swa=3)
    swa_cells.apply(swa_cells.find_slot(ub), ub)
    np.testing.assert_array_equal(swa_cells.build_mask(ub, n_kv=6), expected)
    # a cache's own window can be switched off for a global layer's mask
    assert (swa_cells.build_mask(ub, n_kv=6, swa_type=SWAType.NONE)[4] == 0).sum() == 5


@pytest.mark.parametrize("n_swa", [3, 8])
def test_swa_mask_rule(n_swa):
    cells = KVCells(32, 2)
    ub = _ub(list(range(12)) + list(range(12)), [0] * 12 + [1] * 12)
    cells.apply(cells.find_slot(ub), ub)
    mask = cells.build_mask(ub, n_kv=32, swa_type=SWAType.STANDARD, n_swa=n_swa)
    for i in range(24):
        seq_i, p1 = divmod(i, 12)
        for j in range(32):
            seq_j, p0 = divmod(j, 12)
            visible = j < 24 and seq_i == seq_j and p1 - n_swa < p0 <= p1
            assert mask[i, j] == (0 if visible else X), (i, j)


def test_chunked_and_symmetric_masks():
    cells = KVCells(8, 1)
    ub = _ub(list(range(6)))
    cells.apply(cells.find_slot(ub), ub)
    chunked = cells.build_mask(ub, n_kv=6, swa_type=SWAType.CHUNKED, n_swa=4)
    np.testing.assert_array_equal(chunked[3], [0, 0, 0, 0, X, X])
    np.testing.assert_array_equal(chunked[5], [X, X, X, X, 0, 0])
    symmetric = cells.build_mask(ub, n_kv=6, causal=False, swa_type=SWAType.SYMMETRIC, n_swa=4)
    np.testing.assert_array_equal(symmetric[2], [0, 0, 0, 0, 0, X])


def test_mask_arguments():
    cells = KVCells(8, 1)
    ub = _ub([0, 1])
    with pytest.raises(ValueError, match="n_tokens_pad = 1"):
        cells.build_mask(ub, n_kv=8, n_tokens_pad=1)
    with pytest.raises(ValueError, match="n_kv = 9"):
        cells.build_mask(ub, n_kv=9)


def test_write_indices_drop_padded_rows():
    cells = KVCells(8, 1)
    idx = cells.write_indices(SlotInfo(np.array([3, 4], np.int32)), n_tokens_pad=4)
    assert idx.tolist() == [3, 4, 8, 8]
    import jax.numpy as jnp
    written = jnp.zeros(8).at[idx].set(jnp.array([1.0, 2.0, 9.0, 9.0]), mode="drop")
    assert written.tolist() == [0, 0, 0, 1, 2, 0, 0, 0]
    with pytest.raises(ValueError, match="smaller than the slot"):
        cells.write_indices(SlotInfo(np.array([3, 4], np.int32)), n_tokens_pad=1)


# --- sliding-window cache ---

def test_swa_cache_reuses_cells_out_of_the_window():
    cells = KVCells(4, 1, swa_type=SWAType.STANDARD, n_swa=2)
    _put(cells, [0, 1, 2, 3])
    assert _put(cells, [4]).idxs.tolist() == [0]
    assert cells.pos.tolist() == [4, 1, 2, 3] and cells.seq_pos_min(0) == 1
    assert _put(cells, [5]).idxs.tolist() == [1]
    mask = cells.build_mask(_ub([5]), n_kv=4)
    np.testing.assert_array_equal(mask, [[0, 0, X, X]])  # sees positions 4 and 5
    # the next token (6) sees 5 and 6: cells holding 2, 3 and 4 may be taken, 5 may not
    assert cells.find_slot(_ub([6, 7, 8])).idxs.tolist() == [2, 3, 0]
    assert cells.find_slot(_ub([6, 7, 8, 9])) is None


def test_swa_cache_reuse_follows_each_sequence():
    cells = KVCells(6, 2, swa_type=SWAType.STANDARD, n_swa=2)
    _put(cells, [0, 1, 2], [0, 0, 0])
    # sequence 0's next token (3) no longer sees positions 0 and 1: their cells are free
    assert _put(cells, [0, 1, 2, 3], [1, 1, 1, 1]).idxs.tolist() == [3, 4, 5, 0]
    assert cells.pos.tolist() == [3, 1, 2, 0, 1, 2] and cells.seq.tolist() == [2, 1, 1, 2, 2, 2]
    # now: seq 0 (next 3) frees position 1 (cell 1); seq 1 (next 4) frees 0, 1, 2 (cells 3-5)
    assert cells.find_slot(_ub([3], [0])).idxs.tolist() == [1]
    assert cells.find_slot(_ub([3, 4, 5, 6], [0] * 4)).idxs.tolist() == [1, 3, 4, 5]
    assert cells.find_slot(_ub([3, 4, 5, 6, 7], [0] * 5)) is None


def test_reusing_a_cell_purges_older_positions():
    cells = KVCells(4, 1, swa_type=SWAType.STANDARD, n_swa=2)
    _put(cells, [0, 1, 2, 3])
    cells.apply(SlotInfo(np.array([2], np.int32)), _ub([4]))
    # overwriting position 2 drops 0 and 1 too, so the sequence stays contiguous
    assert cells.pos.tolist() == [-1, -1, 4, 3]
    assert (cells.seq_pos_min(0), cells.seq_pos_max(0)) == (3, 4)


def test_apply_checks_the_slot():
    cells = KVCells(4, 2)
    with pytest.raises(ValueError, match="slot of 1 cells for a ubatch of 2 tokens"):
        cells.apply(SlotInfo(np.array([0], np.int32)), _ub([0, 1]))
    _put(cells, [0], [[0, 1]])
    with pytest.raises(ValueError, match="slot cell 0 is shared by several sequences"):
        cells.apply(SlotInfo(np.array([0], np.int32)), _ub([1]))


def test_constructor_arguments():
    with pytest.raises(ValueError, match="n_ctx = 0"):
        KVCells(0, 1)
    with pytest.raises(ValueError, match="n_seq_max = 65"):
        KVCells(8, 65)
    with pytest.raises(ValueError, match="needs n_swa > 0"):
        KVCells(8, 1, swa_type=SWAType.STANDARD)


def test_allocator_continues_the_cells():
    cells = KVCells(16, 2)
    _put(cells, [0, 1, 2])
    balloc = BatchAllocator()
    balloc.init(Batch(tokens=[1, 2, 3], seq_id=[0, 1, 0]), n_vocab=10, n_embd=1, n_seq_max=2,
                memory=cells)
    assert balloc.pos.tolist() == [3, 0, 4]
    with pytest.raises(BatchError, match="must continue at 3, but it starts at 2"):
        balloc.init(Batch(tokens=[1], pos=[2]), n_vocab=10, n_embd=1, n_seq_max=2, memory=cells)


def test_mask_of_an_mrope_image_is_causal_over_its_grid():
    """The tokens of an M-RoPE image share one position; each sees the image's cells up to its
    own place in the grid, row by row (llama.cpp's is_2d_gt), whichever ubatch wrote them."""
    cells = KVCells(16, 1)
    _put(cells, [0, 1])                                                 # text before the image
    balloc = BatchAllocator()
    grid = np.array([[2] * 4, [2, 2, 3, 3], [2, 3, 2, 3], [0] * 4])      # a 2 x 2 image at t = 2
    balloc.init(Batch(embd=np.zeros((4, 1)), pos=grid), n_vocab=1, n_embd=1, n_seq_max=1, mrope=True)
    masks = []
    for ub in balloc.split_simple(3):
        slot = cells.find_slot(ub)
        assert slot is not None
        cells.apply(slot, ub)
        masks.append(cells.build_mask(ub, 6))
    assert np.isneginf(masks[0]).tolist() == [[False, False, False, True, True, True],
                                              [False, False, False, False, True, True],
                                              [False, False, False, False, False, True]]
    assert not np.isneginf(masks[1]).any()
    text = _ub([4])
    cells.apply(cells.find_slot(text), text)
    assert not np.isneginf(cells.build_mask(text, 7)).any()            # after the image: all of it
