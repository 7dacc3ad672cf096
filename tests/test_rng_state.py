"""Which CUDA generator state a rank saves in its RNG file, and which saved state goes onto
which device on resume (rank.checkpoint): every rank sees every card of its node, so a file
holding all of them could not be restored on fewer cards (IndexError in
torch.cuda.set_rng_state_all) and restored another rank's device on more. Fake states on CPU
stand for the generators; the device objects are plain ``torch.device("cuda", i)``."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from memtune.rank.checkpoint import (
    _rng_state,
    _set_rng_state,
    cuda_rng_to_restore,
    cuda_rng_to_save,
    rng_file_for,
)

CPU = torch.device("cpu")


def cuda(i: int) -> torch.device:
    return torch.device("cuda", i)


def fake_state(i: int) -> torch.Tensor:
    """Stands for the generator state of card i (torch's are uint8 tensors)."""
    return torch.full((16,), i, dtype=torch.uint8)


def card_of(state: torch.Tensor) -> int:
    return int(state[0])


def node_cards(n: int) -> list[torch.Tensor]:
    """What torch.cuda.get_rng_state_all() returned on a rank that saw n cards: the old file."""
    return [fake_state(i) for i in range(n)]


def save(rank_device: torch.device) -> dict[str, object]:
    return cuda_rng_to_save(rank_device, lambda device: fake_state(device.index))


def test_a_gpu_rank_saves_its_own_cards_generator_only() -> None:
    for i in range(4):
        saved = save(cuda(i))
        assert list(saved) == ["cuda"]
        assert card_of(saved["cuda"]) == i  # type: ignore[arg-type]


def test_a_cpu_rank_saves_no_cuda_state() -> None:
    assert save(CPU) == {}


def test_resume_on_the_same_ranks_restores_each_cards_own_state() -> None:
    files = {r: save(cuda(r)) for r in range(4)}
    for r in range(4):
        restored = cuda_rng_to_restore(files[r], r, cuda(r))
        assert restored is not None and card_of(restored) == r


def test_resume_on_fewer_ranks_restores_one_state_onto_the_ranks_own_card() -> None:
    """4 → 2 (docs/resume.md's example): rank r reads its own file of the 4-rank run."""
    files = {r: save(cuda(r)) for r in range(4)}
    for r in range(2):
        restored = cuda_rng_to_restore(files[r], r, cuda(r))
        assert restored is not None and card_of(restored) == r


def test_resume_on_more_ranks_gives_the_new_ranks_rank0s_state_on_their_own_card() -> None:
    """2 → 4: ranks 2 and 3 have no file of their own and read rank 0's."""
    files = {r: save(cuda(r)) for r in range(2)}
    for r in range(4):
        saved_by = r if r in files else 0
        restored = cuda_rng_to_restore(files[saved_by], saved_by, cuda(r))
        assert restored is not None and card_of(restored) == saved_by


def test_an_old_file_gives_the_state_of_the_card_its_rank_used() -> None:
    """Saved before: every rank's file held the states of all 4 cards of its node."""
    old = {r: {"cuda": node_cards(4)} for r in range(4)}
    # the same ranks, fewer (4 → 2), more from rank 0's file (→ 6)
    for saved_by, device in [(0, 0), (1, 1), (2, 2), (3, 3), (0, 1), (1, 0), (0, 5)]:
        restored = cuda_rng_to_restore(old[saved_by], saved_by, cuda(device))
        assert restored is not None and card_of(restored) == saved_by


def test_an_old_file_of_a_second_node_gives_its_local_card() -> None:
    """2 nodes × 4 ranks: rank 5 used card 1 of its node."""
    restored = cuda_rng_to_restore({"cuda": node_cards(4)}, 5, cuda(1))
    assert restored is not None and card_of(restored) == 1


def test_an_old_file_listing_fewer_cards_than_the_rank_gives_the_first() -> None:
    restored = cuda_rng_to_restore({"cuda": node_cards(1)}, 3, cuda(3))
    assert restored is not None and card_of(restored) == 0


def test_nothing_is_restored_on_a_cpu_rank_or_from_a_file_without_cuda() -> None:
    assert cuda_rng_to_restore({"cuda": fake_state(0)}, 0, CPU) is None
    assert cuda_rng_to_restore({"cuda": node_cards(4)}, 0, CPU) is None
    assert cuda_rng_to_restore({}, 0, cuda(0)) is None
    assert cuda_rng_to_restore({"cuda": []}, 0, cuda(0)) is None


def test_the_rng_file_of_a_rank_that_was_not_one_is_rank0s(tmp_path: Path) -> None:
    for r in range(2):
        torch.save(save(cuda(r)), tmp_path / f"rng_rank{r}.pt")
    assert [rng_file_for(tmp_path, r) for r in range(4)] == [0, 1, 0, 0]
    loaded = torch.load(tmp_path / "rng_rank1.pt", weights_only=True)
    restored = cuda_rng_to_restore(loaded, 1, cuda(1))
    assert restored is not None and card_of(restored) == 1


def test_a_cpu_ranks_rng_file_round_trips_exactly(tmp_path: Path) -> None:
    """What exact resume on CPU ranks rests on: python, numpy and torch continue as saved."""
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    torch.save(_rng_state(CPU), tmp_path / "rng_rank0.pt")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    state = torch.load(tmp_path / "rng_rank0.pt", weights_only=True)
    assert "cuda" not in state
    _set_rng_state(state, 0, CPU)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert again[0] == expected[0] and again[1] == expected[1]
    assert torch.equal(again[2], expected[2])
