"""assemble: a tensor one piece already holds whole is handed on without a copy (export then
writes the model's own memory, no second full-model copy); split pieces are still joined."""

from __future__ import annotations

import torch

from megatron_plugins.weights.streaming import WeightPiece, assemble


def test_a_whole_piece_is_not_copied_and_split_pieces_are_joined():
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    strided = full.t()  # whole but not contiguous: written as a contiguous copy
    got = assemble([WeightPiece("whole", full, (6, 4), (0, 0)),
                    WeightPiece("strided", strided, (4, 6), (0, 0)),
                    WeightPiece("halves", full[3:], (6, 4), (3, 0)),
                    WeightPiece("halves", full[:3], (6, 4), (0, 0))])
    assert got["whole"].data_ptr() == full.data_ptr()
    assert got["strided"].is_contiguous() and torch.equal(got["strided"], strided)
    assert torch.equal(got["halves"], full) and got["halves"].data_ptr() != full.data_ptr()
