"""What a cell produced, and the capped text the model gets back.

Control characters: `Stream.text` keeps exactly what the cell wrote (decoded), but `feedback()`,
the text that goes into the model's prompt, escapes every C0/C1 control character and DEL except
newline and tab as a visible `\\xNN` (and turns CRLF into a newline). Raw control bytes (ANSI
escapes, NUL, backspace, lone carriage returns) carry no meaning for the model, can break
tokenizers or later tooling that treats text as C strings, and can make a trace display something
other than what it holds; an escape keeps the information and the length bounded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Literal

Status = Literal["ok", "error", "timeout", "killed", "output_truncated"]


@dataclass(frozen=True)
class Stream:
    head: str
    tail: str
    omitted: int  # bytes dropped between head and tail
    total: int  # bytes the cell wrote

    @property
    def truncated(self) -> bool:
        return self.omitted > 0

    @property
    def text(self) -> str:
        if self.omitted:
            return f"{self.head}\n[... {self.omitted} bytes omitted ...]\n{self.tail}"
        return self.head + self.tail

    def capped(self, max_chars: int, escape: Callable[[str], str] = lambda s: s) -> str:
        """At most max_chars of the stream (after `escape`): its start and its real end around a
        marker with the true count of bytes left out."""
        if not self.omitted:
            return cap_text(escape(self.head + self.tail), max_chars)
        head_src, tail_src = escape(self.head), escape(self.tail)
        keep = max(0, max_chars - 48)
        head = head_src[: keep * 2 // 3]
        n_tail = keep - len(head)
        tail = tail_src[len(tail_src) - n_tail:] if n_tail > 0 else ""
        # bytes of the stream not shown: the omitted middle plus what was cut of head and tail
        dropped = (self.total - _raw_bytes(self.head, head_src, len(head))
                   - _raw_bytes(self.tail, tail_src, len(tail), end=True))
        return f"{head}\n[... {dropped} bytes omitted ...]\n{tail}"

    @classmethod
    def empty(cls) -> "Stream":
        return cls("", "", 0, 0)


@dataclass(frozen=True)
class CellResult:
    status: Status
    stdout: Stream
    stderr: Stream
    exit_code: int | None = None
    signal: str | None = None
    seconds: float = 0.0  # wall time of the cell itself
    queue_seconds: float = 0.0  # waiting for a free worker
    total_seconds: float = 0.0  # request to reply, as the caller saw it
    restarted: bool = False  # a stateful session had to be recreated (see `note`)
    note: str = ""
    reason: str = ""  # why a killed cell was killed, when known (memory limit, CPU limit, crash)
    # the sandbox's own failure, not the code's: the cell was lost with its worker, or never ran (no
    # worker could start, a session still restoring); "" when the sandbox did its part. Harnesses
    # count these apart from the model's errors: a problem that lost its tools deserves a retry.
    fault: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "output_truncated")

    def feedback(self, max_chars: int = 1000) -> str:
        """Text for the model's output block: stdout, then the error, within `max_chars`.

        Long output keeps its beginning and its end around an explicit marker, so the model sees
        both how the output started and how it finished. The error goes last and its exception
        line (type and the start of its message) always arrives, however long the message or the
        traceback: that line is what the model most needs (see `cap_error`).
        """
        notices = []
        err = ""
        if self.status == "timeout":
            notices.append(f"TimeoutError: the code ran longer than the time limit ({self.seconds:.1f}s) "
                           "and was stopped")
        elif self.status == "killed":
            why = ": ".join(p for p in (self.signal, self.reason) if p) or "cause unknown"
            notices.append(f"The process was killed ({why})")
        elif self.status == "error":
            err = escape_controls(self.stderr.text.strip()) or f"process exited with code {self.exit_code}"
        if self.note:
            notices.append(self.note)
        notice = _cap_head(escape_controls("\n".join(n.rstrip("\n") for n in notices)), max(1, max_chars * 2 // 3))
        out_full = self.stdout.capped(10 ** 9, escape_controls).rstrip("\n")
        room = max_chars - len(notice) - (1 if notice else 0)
        if err:
            # the error gets what stdout leaves, at least half; stdout at most what the error leaves
            err_room = max(room // 2, room - len(out_full) - 1)
            err = cap_error(err, err_room)
            room -= len(err) + 1
        out = self.stdout.capped(max(0, room), escape_controls).rstrip("\n") if len(out_full) > room else out_full
        if room <= 0:
            out = ""
        return "\n".join(p for p in (out, err, notice) if p)


_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def escape_controls(text: str) -> str:
    """`text` with control characters other than newline and tab shown as `\\xNN` (see module doc)."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text.replace("\r\n", "\n"))


def cap_text(text: str, max_chars: int) -> str:
    """`text` if short enough, else its start and end around a marker saying how much was cut."""
    if len(text) <= max_chars:
        return text
    keep = max(0, max_chars - 48)
    head = keep * 2 // 3
    tail = keep - head
    cut = len(text) - head - tail
    return text[:head] + f"\n[... {cut} characters omitted ...]\n" + (text[len(text) - tail:] if tail else "")


KILL_REASONS = {"SIGXCPU": "CPU time limit", "SIGXFSZ": "file size limit"}


def from_reply(reply: dict[str, Any], queue_seconds: float, total_seconds: float, oom_kills: int = 0,
               memory_mb: int = 0, task_limit_hits: int = 0, max_processes: int = 0) -> CellResult:
    """The CellResult of a checked worker reply; `oom_kills` > 0 when the cgroup killed for memory,
    `task_limit_hits` > 0 when it refused forks or thread starts (pids.max).

    A cell that runs into the thread and process limit fails in ways that do not name it ("can't
    start new thread", BlockingIOError on fork, or a loop that retries until the time limit), so
    the result says it in words, whatever its status.
    """
    out = Stream(**reply["stdout"])
    err = Stream(**reply["stderr"])
    st = reply["status"]
    code, sig = st.get("code"), st.get("signal")
    reason = ""
    if st["kind"] == "timeout":
        status: Status = "timeout"
    elif st["kind"] == "crash":
        status, reason = "killed", "the python process broke its protocol with the sandbox and was ended"
    elif st["kind"] == "signal":
        status = "killed"
        if oom_kills and sig == "SIGKILL":
            reason = f"memory limit of {memory_mb} MB for the cell and all its processes exceeded"
        else:
            reason = KILL_REASONS.get(sig, "")
    elif code == 0:
        status = "output_truncated" if out.truncated or err.truncated else "ok"
    else:
        status = "error"
    if oom_kills and not reason:
        reason = f"a process of the cell was killed: memory limit of {memory_mb} MB exceeded"
    if task_limit_hits:
        tasks = f"too many threads or processes: the limit is {max_processes} for a cell and all it starts"
        reason = f"{reason}; {tasks}" if reason else tasks
    note = f"[{reason}]" if reason and status != "killed" else ""
    return CellResult(status, out, err, code, sig, reply.get("seconds", 0.0), queue_seconds, total_seconds,
                      note=note, reason=reason if status == "killed" else "")


def _raw_bytes(raw: str, escaped: str, shown: int, end: bool = False) -> int:
    """Bytes of `raw` behind the first (or, with `end`, last) `shown` characters of its escaped form."""
    if shown >= len(escaped):
        return len(raw.encode())
    if escaped == raw:
        part = raw[len(raw) - shown:] if end else raw[:shown]
        return len(part.encode()) if shown else 0
    return round(len(raw.encode()) * shown / max(1, len(escaped)))  # escapes present: proportional estimate


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(?::|$)")


def split_error(text: str) -> tuple[str, str]:
    """(traceback, exception) of a python error text: the exception is the last non-indented block
    (type, colon, message, which may span lines), the traceback everything before it."""
    lines = text.split("\n")
    start = None
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if _EXC_LINE.match(line) and not line.startswith(("Traceback (most recent call last)", "During handling",
                                                          "The above exception")):
            start = i
            # a multi-line message: earlier non-indented lines that are not a traceback header belong to it
            if i == 0 or lines[i - 1].startswith((" ", "Traceback", "\t")) or not lines[i - 1].strip():
                break
    if start is None:
        return "", text
    return "\n".join(lines[:start]), "\n".join(lines[start:])


def cap_error(text: str, max_chars: int) -> str:
    """An error text within max_chars that keeps its exception line first in priority: the type
    and the start of the message, then the end of the message, then the innermost frames."""
    if len(text) <= max_chars:
        return text
    frames, exc = split_error(text)
    exc = _cap_head(exc, max_chars * 2 // 3 if frames and max_chars >= 150 else max_chars)
    room = max_chars - len(exc) - 1
    marker = "[... traceback cut ...]\n"
    if not frames or room < len(marker) + 16:
        return exc
    if len(frames) > room:
        frames = marker + frames[len(frames) - (room - len(marker)):]
    return frames + "\n" + exc


def _cap_head(text: str, max_chars: int) -> str:
    """Mostly the start of `text` (where the exception type and message begin), a little of its end."""
    if len(text) <= max_chars:
        return text
    if max_chars < 100:
        return text[: max(0, max_chars - 6)] + " [...]"
    marker = "\n[... {} characters omitted ...]\n"
    keep = max_chars - len(marker) - 8
    head = text[: keep * 3 // 4]
    tail = text[len(text) - (keep - len(head)):]
    return head + marker.format(len(text) - len(head) - len(tail)) + tail
