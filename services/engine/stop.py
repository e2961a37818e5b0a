"""Stop-string matching over a stream of text deltas.

A stop string may arrive split across any number of deltas, so text that could
be the beginning of a stop string is held back until it either completes the
stop string (generation stops; neither it nor anything after it is emitted) or
stops matching (it is released). When several stop strings could apply,
the one that completes first wins.
"""

from __future__ import annotations

from nibble.services.errors import InvalidRequestError


class StopStringMatcher:
    """Filters one request's text stream against its stop strings.

    Held-back text is always shorter than the longest stop string, and each
    ``feed`` costs O((len(delta) + longest stop) * number of stops).
    """

    def __init__(self, stops: tuple[str, ...]):
        if any(not s for s in stops):
            raise InvalidRequestError("stop strings must be non-empty", param="stop")
        self._stops = tuple(dict.fromkeys(stops))  # dedupe, keep order
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text_delta: str) -> tuple[str, bool]:
        """Add generated text; returns (text safe to emit now, stopped).

        Once stopped, every later call returns ("", True).
        """
        if self._stopped:
            return "", True
        if not self._stops:
            return text_delta, False
        buf = self._held + text_delta
        cut = self._earliest_match(buf)
        if cut is not None:
            self._stopped = True
            self._held = ""
            return buf[:cut], True
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release held-back text when generation ends for another reason."""
        if self._stopped:
            return ""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buf: str) -> int | None:
        """Start index of the stop string that completes first in buf, or None.

        "First" is by end position (ties: the longer stop), which is what a
        character-by-character stream would hit, so the result does not depend
        on how the text was split into deltas.
        """
        best = None  # (end, -len(stop), start)
        for stop in self._stops:
            i = buf.find(stop)
            if i != -1:
                key = (i + len(stop), -len(stop), i)
                best = key if best is None or key < best else best
        return None if best is None else best[2]

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest
