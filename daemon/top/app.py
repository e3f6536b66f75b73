"""`councild top`'s live screen: a textual app over a ``TopView``, fed by a polling thread.

The poller owns the one protocol client (a ZeroMQ socket stays on the thread that made it)
and asks for the daemon's status every ``interval`` seconds over the same socket as
`councild status`; a daemon that does not answer within ``timeout`` is shown as unreachable
with its last known state, and the next poll tries again (the client reconnects by itself).
Textual owns the terminal: keys, resizes, redraws. Keys: s sorts the seats, p pauses (no
polls, the screen holds), enter on a seat or a decision expands it, escape closes that, q quits.
"""

from __future__ import annotations

import threading
import time

import msgspec
from rich.console import Group
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import DataTable, Footer, Static

from protocol.client import Client, CouncilError

from .panels import DECISION_COLUMNS, SEAT_COLUMNS, batch_panel, decision_cells, header, head_panel, memory_panel, \
    seat_cells, step_panel
from .view import DecisionRow, TopView, decision_detail, seat_detail


def _same(a: tuple[str, object], b: tuple[str, object]) -> bool:
    """Enter on the row already expanded closes it (a decision is the same across replies
    when its name, sentence and time agree)."""
    if a[0] != b[0]:
        return False
    if a[0] == "seat":
        return a[1] == b[1]
    x, y = a[1], b[1]
    assert isinstance(x, DecisionRow) and isinstance(y, DecisionRow)
    return (x.decision, x.sentence) == (y.decision, y.sentence) and abs((x.at or 0) - (y.at or 0)) < 0.5


def _keyed(rows: list[DecisionRow]) -> dict[str, DecisionRow]:
    """Row keys that stay with a decision as newer ones push it down (the cursor follows it)."""
    out: dict[str, DecisionRow] = {}
    for r in rows:
        base = f"{r.at:.1f}:{r.decision}" if r.at is not None else f"?:{r.decision}"
        n = 0
        while f"{base}:{n}" in out:
            n += 1
        out[f"{base}:{n}"] = r
    return out


class Poller(threading.Thread):
    """Owns the client from start on (made on the main thread, so a malformed endpoint is a
    usage error there; a socket may move to another thread across the start's barrier)."""

    def __init__(self, app: "TopApp", client: Client, interval: float):
        super().__init__(name="councild-top-poller", daemon=True)
        self.app, self.client, self.interval = app, client, interval
        self.stopping = threading.Event()

    def run(self) -> None:
        client = self.client
        try:
            while not self.stopping.is_set():
                if not self.app.view.paused:
                    self._poll(client)
                self.stopping.wait(self.interval)
        finally:
            client.close()

    def _poll(self, client: Client) -> None:
        try:
            reply, error = msgspec.to_builtins(client.status()), None
        except CouncilError as exc:  # DaemonUnavailable included: shown, and the next poll retries
            reply, error = None, str(exc)
        try:
            self.app.call_from_thread(self.app.show, reply, error)
        except RuntimeError:  # the app is closing
            self.stopping.set()


class TopApp(App):
    TITLE = "councild top"
    CSS = """
    #header { height: auto; padding: 0 1; }
    #upper { height: 2fr; }
    #seats { width: 3fr; }
    #side { width: 2fr; overflow-y: auto; }
    #decisions { height: 1fr; }
    #detail { height: auto; max-height: 40%; border: round $accent; padding: 0 1; overflow-y: auto; display: none; }
    """
    BINDINGS = [
        Binding("q", "quit_top", "quit"),
        Binding("p", "pause", "pause"),
        Binding("s", "sort", "sort seats"),
        Binding("escape", "close_detail", "close"),
    ]

    def __init__(self, client: Client, interval: float = 1.0):
        super().__init__()
        self.view = TopView()
        self.expanded: tuple[str, object] | None = None  # ("seat", name) or ("decision", DecisionRow)
        self.decision_rows: dict[str, DecisionRow] = {}  # the decisions table's row keys
        self.poller = Poller(self, client, interval)

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        with Horizontal(id="upper"):
            yield DataTable(id="seats", cursor_type="row", zebra_stripes=True)
            yield Static(id="side")
        yield DataTable(id="decisions", cursor_type="row")
        yield Static(id="detail")
        yield Footer()

    def on_mount(self) -> None:
        # tab goes seats -> decisions only: the side panels and the detail scroll, which would
        # make them stops on the way.
        self.query_one("#side", Static).can_focus = False
        self.query_one("#detail", Static).can_focus = False
        self.query_one("#seats", DataTable).add_columns(*SEAT_COLUMNS)
        self.query_one("#decisions", DataTable).add_columns(*DECISION_COLUMNS)
        self.query_one("#header", Static).update(header(self.view))
        self.poller.start()

    # ------------------------------------------------------------------ drawing
    def show(self, reply: dict | None, error: str | None) -> None:
        if self.view.paused:  # a poll that was under way when p was pressed: the screen holds
            return
        if reply is not None:
            self.view.update(reply, time.monotonic())
        else:
            self.view.unreachable(error or "no reply", time.time())
        self.redraw()

    def redraw(self) -> None:
        self.query_one("#header", Static).update(header(self.view))
        self._fill(self.query_one("#seats", DataTable), [(r.seat, seat_cells(r)) for r in self.view.seats()])
        self.query_one("#side", Static).update(Group(batch_panel(self.view), head_panel(self.view),
                                                     memory_panel(self.view), step_panel(self.view)))
        self.decision_rows = _keyed(self.view.decisions())
        self._fill(self.query_one("#decisions", DataTable),
                   [(key, decision_cells(r)) for key, r in self.decision_rows.items()])
        self._show_detail()

    @staticmethod
    def _fill(table: DataTable, rows: list[tuple[str, tuple[str, ...]]]) -> None:
        """Replace the rows, keeping the cursor on the same row key where it is still there."""
        keep = None
        if table.row_count and table.cursor_row is not None:
            try:
                keep = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
            except Exception:
                keep = None
        table.clear()
        for key, cells in rows:
            table.add_row(*cells, key=key)
        if keep is not None:
            try:
                table.move_cursor(row=table.get_row_index(keep))
            except Exception:
                pass

    def _show_detail(self) -> None:
        panel = self.query_one("#detail", Static)
        text = None
        if self.expanded is not None:
            kind, what = self.expanded
            if kind == "seat":
                row = next((r for r in self.view.seats() if r.seat == what), None)
                text = seat_detail(row) if row is not None else f"seat {what}: gone from the daemon's table"
            else:
                assert isinstance(what, DecisionRow)
                text = decision_detail(what)
        panel.display = text is not None
        if text is not None:
            panel.update(text)

    # ------------------------------------------------------------------ keys
    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        key = event.row_key.value
        if event.data_table.id == "seats":
            choice: tuple[str, object] = ("seat", key)
        else:
            rows = list(self.decision_rows.values())
            # A key can drift by a rounding of the daemon's clock between two replies: the row
            # under the cursor is the one meant then.
            row = self.decision_rows.get(key) or (rows[event.cursor_row] if event.cursor_row < len(rows) else None)
            if row is None:
                return
            choice = ("decision", row)
        self.expanded = None if self.expanded is not None and _same(self.expanded, choice) else choice
        self._show_detail()

    def action_close_detail(self) -> None:
        self.expanded = None
        self._show_detail()

    def action_pause(self) -> None:
        self.view.paused = not self.view.paused
        self.query_one("#header", Static).update(header(self.view))

    def action_sort(self) -> None:
        self.view.next_sort()
        self.redraw()

    def action_quit_top(self) -> None:
        self.poller.stopping.set()
        self.exit(0)
