"""Where in the user's program a rank is: the innermost frames of a thread still
running, and the frame an exception was raised from (the innermost one outside
torch's and cpsim's own files, with its source line). No torch here.

CPSIM_TRACEBACK=1 in the environment adds the exception's whole traceback to
what a failed rank reports.
"""
import os
import sys
import threading
import traceback

# The folders of torch's and cpsim's own files (set by cpsim.torch) and the
# thread module, where a spawned rank's stack begins: not the user's frames.
INTERNAL = [os.path.dirname(os.path.abspath(__file__)) + os.sep, threading.__file__]


def running(thread):
    """The innermost frames of a running thread, as 'file:line in function' text."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "(it ended meanwhile)"
    stack = traceback.extract_stack(frame)
    return " <- ".join("%s:%d in %s" % (os.path.basename(f.filename), f.lineno, f.name) for f in reversed(stack[-3:]))


def _own(filename):
    return not any(filename.startswith(p) for p in INTERNAL) and not filename.startswith("<")


def raised(error):
    """'at file.py:12 in fn: the source line' for the innermost frame of the
    user's own that `error` passed through ('' when none did)."""
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    mine = [f for f in frames if _own(f.filename)]
    if not mine:
        return ""
    f = mine[-1]
    text = "at %s:%d in %s" % (os.path.basename(f.filename), f.lineno, f.name)
    return text + (": " + f.line.strip() if f.line and f.line.strip() else "")


def failure(error):
    """A rank's exception as a report reads it: 'Type: message', the user's
    frame it came from on the next line, and with CPSIM_TRACEBACK=1 the whole
    traceback."""
    text = "%s: %s" % (type(error).__name__, error)
    at = raised(error)
    if at:
        text += "\n  " + at
    if os.environ.get("CPSIM_TRACEBACK") == "1":
        text += "\n" + "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
    else:
        text += " (CPSIM_TRACEBACK=1: the whole traceback)" if at else ""
    return text
