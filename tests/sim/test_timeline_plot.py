"""plot_timeline stays legible for large schedules and fast to draw."""

from __future__ import annotations

import time

from paratrain.schedule import generate
from paratrain.sim import simulate
from paratrain.sim.trace import plot_timeline


def _events(stages: int, microbatches: int, virtual: int = 1):
    name = "interleaved" if virtual > 1 else "1f1b"
    sched = generate(name, stages=stages, microbatches=microbatches, virtual_stages=virtual)
    return simulate(sched, record=True).events


def test_small_schedule_is_one_panel_with_outlined_boxes():
    fig = plot_timeline(_events(4, 8), 4, title="1F1B")
    assert len(fig.axes) == 1
    ax = fig.axes[0]
    assert ax.get_xlim()[0] == 0.0
    labels = {t.get_text() for t in ax.texts}
    assert {str(m) for m in range(8)} <= labels  # every micro-batch labelled
    assert all(c.get_linewidth()[0] > 0 for c in ax.collections)  # outlined boxes


def test_dense_schedule_adds_a_zoomed_panel_and_draws_fast():
    # 24 micro-batches x 12 chunks per rank: 576 compute actions per rank, the demo's shape.
    events = _events(8, 24, virtual=12)
    t0 = time.process_time()
    fig = plot_timeline(events, 8, title="demo")
    fig.canvas.draw()
    assert time.process_time() - t0 < 20  # one draw call per row and style, not per action
    whole, zoom = fig.axes[:2]
    end = max(e.start_s + e.duration_s for e in events)
    assert whole.get_xlim() == (0.0, end)
    lo, hi = zoom.get_xlim()
    assert 0 <= lo < hi < end and hi - lo < end / 4
    assert all(c.get_linewidth()[0] == 0 for c in whole.collections if hasattr(c, "get_linewidth"))
    zoom_labels = [t.get_text() for t in zoom.texts]
    assert zoom_labels and all("c" in t for t in zoom_labels)  # micro-batch and chunk: "3c9"


def test_window_draws_only_that_stretch():
    events = _events(4, 8)
    fig = plot_timeline(events, 4, window=(2.0, 6.0))
    assert len(fig.axes) == 1 and fig.axes[0].get_xlim() == (2.0, 6.0)
