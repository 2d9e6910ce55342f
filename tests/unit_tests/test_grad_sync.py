"""The no-sync window the stock schedule opens is closed again even when a step raised in it."""

from __future__ import annotations

import contextlib

from megatron_plugins.step.grad_sync import CrossGridGradSync


class _FakeMimo:
    """Stands in for MimoModel.no_sync: records whether DDP grad sync is held back."""

    def __init__(self) -> None:
        self.held_back = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.held_back += 1
        try:
            yield
        finally:
            self.held_back -= 1


def test_a_window_left_open_by_a_raising_step_is_closed_by_the_next_one():
    model = _FakeMimo()
    sync = CrossGridGradSync(model, {})
    # The stock schedule enters the window by hand and, when forward raises, never exits it.
    stale = sync.no_sync()
    stale.__enter__()
    assert model.held_back == 1
    # Next step: entering again first closes the stale window, so hooks are held back once.
    window = sync.no_sync()
    window.__enter__()
    assert model.held_back == 1
    window.__exit__(None, None, None)
    assert model.held_back == 0


def test_normal_windows_open_and_close_once():
    model = _FakeMimo()
    sync = CrossGridGradSync(model, {})
    for _ in range(3):
        with sync.no_sync():
            assert model.held_back == 1
        assert model.held_back == 0
