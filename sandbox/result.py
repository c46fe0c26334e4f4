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
from typing import Any, Literal

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

    def capped(self, max_chars: int) -> str:
        """At most ~max_chars of the stream: its start and its end around a marker with the true count."""
        if not self.omitted:
            return cap_text(self.head + self.tail, max_chars)
        marker_budget = 48
        keep = max(0, max_chars - marker_budget)
        head = self.head[: keep * 2 // 3]
        tail = self.tail[len(self.tail) - (keep - len(head)):] if keep - len(head) > 0 else ""
        dropped = self.total - len(head.encode()) - len(tail.encode())
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

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "output_truncated")

    def feedback(self, max_chars: int = 1000) -> str:
        """Text for the model's output block: stdout, then the error, capped to `max_chars`.

        Long output keeps its beginning and its end around an explicit marker, so the model sees
        both how the output started and how it finished.
        """
        parts = []
        if self.status == "timeout":
            parts.append(f"TimeoutError: the code ran longer than the time limit ({self.seconds:.1f}s) and was stopped")
        elif self.status == "killed":
            why = ": ".join(p for p in (self.signal, self.reason) if p) or "cause unknown"
            parts.append(f"The process was killed ({why})")
        elif self.status == "error":
            err = self.stderr.text.strip() or f"process exited with code {self.exit_code}"
            parts.append(err)
        if self.note:
            parts.append(self.note)
        tail_text = "\n".join(p.rstrip("\n") for p in parts if p)
        # the error/notice is what the model most needs: keep it whole, cap stdout around it
        room = max(max_chars // 2, max_chars - len(tail_text) - 1)
        out = self.stdout.capped(room).rstrip("\n")
        return cap_text(escape_controls("\n".join(p for p in (out, tail_text) if p)), max_chars)


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
               memory_mb: int = 0) -> CellResult:
    """The CellResult of a checked worker reply; `oom_kills` > 0 when the cgroup killed for memory."""
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
    note = f"[{reason}]" if reason and status != "killed" else ""
    return CellResult(status, out, err, code, sig, reply.get("seconds", 0.0), queue_seconds, total_seconds,
                      note=note, reason=reason if status == "killed" else "")
