"""Executing the book's notebooks with nbclient, without the stalls of one long poll.

``make book``, ``make reproduce``, ``make smoke`` and ``make spread`` execute notebooks through
:func:`client`. nbclient waits for a cell's reply with a single ``poll`` of the kernel's shell
socket lasting up to the whole cell timeout (for ever with no timeout), and reads its output with
one unbounded ``poll`` of the IOPub socket. pyzmq's asyncio polling is edge-triggered: a wake-up
that arrives while the client is not yet waiting can be missed, and that ``poll`` then sleeps until
its timeout although a message is ready. That is the "stall" docs/measurements.md describes (kernel and
client both idle, every thread on its event loop, then the run goes on normally near the cell
timeout; with no timeout, as ``make book`` once had, it hangs for ever). nbval, which polls in
short slices, was never seen to stall. :class:`SlicedClient` gives nbclient's two channels the
same habit: each wait is cut into slices of ``slice_seconds`` and re-polls, which reads a ready
message at the next slice; the overall timeout is unchanged.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from queue import Empty

from nbclient import NotebookClient

SLICE_SECONDS = 0.5


def sliced(get_msg, slice_seconds: float = SLICE_SECONDS):
    """``get_msg(timeout)`` of an async channel, waiting in slices of ``slice_seconds`` until
    ``timeout`` (seconds, ``None``: for ever) has passed; raises :class:`queue.Empty` then."""
    if not slice_seconds > 0:
        raise ValueError(f"slice_seconds must be positive; got {slice_seconds!r}")

    async def get_msg_sliced(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
        while True:
            step = slice_seconds if deadline is None else min(slice_seconds, max(0.0, deadline - time.monotonic()))
            try:
                return await get_msg(timeout=step)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    get_msg_sliced.sliced = True
    return get_msg_sliced


class SlicedClient(NotebookClient):
    """An nbclient ``NotebookClient`` whose shell and IOPub waits poll in short slices."""

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        for channel in (kc.shell_channel, kc.iopub_channel):
            if not getattr(channel.get_msg, "sliced", False):
                channel.get_msg = sliced(channel.get_msg)
        return kc


def client(nb, path: Path, timeout: int | None = None, allow_errors: bool = False) -> SlicedClient:
    """The client that executes notebook ``nb`` (read from ``path``) in ``path``'s folder with the
    python3 kernel; ``timeout`` in seconds per cell (``None``: no limit)."""
    if timeout is not None and (not isinstance(timeout, int) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None; got {timeout!r}")
    return SlicedClient(nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
                        resources={"metadata": {"path": str(Path(path).parent)}})


def environment(profile: str, **extra: str) -> dict:
    """The kernel's environment: this process's, at ``profile``, progress bars off, the figures' phone drawings
    made (these outputs go into the book; ``extra`` may say ``CAPSBOOK_PHONE_FIGURES="0"``), and no
    ``MPLBACKEND`` (the kernel's own inline backend must draw the figures into the outputs)."""
    if profile not in ("ci", "full"):
        raise ValueError(f"profile must be 'ci' or 'full'; got {profile!r}")
    env = {**os.environ, "CAPSBOOK_PROFILE": profile, "CAPSBOOK_PROGRESS": "0", "CAPSBOOK_PHONE_FIGURES": "1", **extra}
    env.pop("MPLBACKEND", None)  # a non-inline backend (agg, set for scripts) would drop every figure
    return env


def main(argv: list[str] | None = None) -> int:
    """``python -m capslib.tools.execute NOTEBOOK --output-dir DIR [--timeout S]``: execute one notebook
    with :class:`SlicedClient` in this process's environment and write the executed copy into DIR
    (what ``make spread`` runs per chapter; nbconvert's client stalled there)."""
    import argparse
    import sys

    import nbformat
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    p = argparse.ArgumentParser(prog="python -m capslib.tools.execute", description=main.__doc__.splitlines()[0])
    p.add_argument("notebook", type=Path)
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--timeout", type=int, default=None, help="seconds per cell (default: no limit)")
    args = p.parse_args(argv)
    if not args.notebook.is_file():
        p.error(f"notebook {args.notebook} does not exist")
    nb = nbformat.read(args.notebook, as_version=4)
    try:
        client(nb, args.notebook, timeout=args.timeout).execute()
        code = 0
    except CellTimeoutError as exc:
        print(f"CellTimeoutError: {exc}", file=sys.stderr)
        code = 1
    except CellExecutionError as exc:
        print(str(exc)[-2000:], file=sys.stderr)
        code = 1
    args.output_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, args.output_dir / args.notebook.name)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
