"""StopChecker against a whole-text reference, for any way of cutting the text into pieces."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvfleet.worker.engine.output.stop_checker import StopChecker


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text before the stop string that completes first (longest of those ending there)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return text[:end - len(max(hits, key=len))], True
    return text, False


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    checker = StopChecker(stops)
    emitted, stopped = [], False
    for piece in pieces:
        out, stopped = checker.feed(piece)
        emitted.append(out)
    return emitted, stopped, checker.flush()


def test_stop_string_spanning_pushes() -> None:
    emitted, stopped, tail = run(["STOP"], ["Hel", "lo ST", "O", "P more", "ignored"])
    assert emitted == ["Hel", "lo ", "", "", ""] and stopped and tail == ""


def test_partial_match_that_fails_is_released() -> None:
    checker = StopChecker(["STOP"])
    assert checker.feed("a ST") == ("a ", False)
    assert checker.feed("OX") == ("STOX", False)
    assert checker.feed("S") == ("", False)
    assert checker.flush() == "S"


def test_stop_at_very_start_and_unicode() -> None:
    assert run(["世界"], ["世", "界 after"]) == (["", ""], True, "")
    assert run(["\n\n"], ["a\n", "\nb"]) == (["a", ""], True, "")


def test_first_completed_stop_wins() -> None:
    # "c" completes before "abcd" could: stop there even though "abcd" starts earlier.
    assert run(["abcd", "c"], ["ab", "cd"]) == (["", "ab"], True, "")
    # Both end at the same character: the longer one (starting first) is cut.
    assert run(["b", "ab"], ["xa", "b"]) == (["x", ""], True, "")


def test_no_stop_strings_passes_through() -> None:
    assert run([], ["a", "b"]) == (["a", "b"], False, "")


@given(text=st.text("abc\n世", max_size=40),
       stops=st.lists(st.text("abc\n世", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=12))
def test_any_cut_emits_text_up_to_first_stop(text: str, stops: list[str],
                                             cuts: list[int]) -> None:
    bounds = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    emitted, stopped, tail = run(stops, pieces)
    want, want_stopped = reference(text, stops)
    assert "".join(emitted) + tail == want
    assert stopped == want_stopped
    # Holds back less than the longest stop string, and only while it could still match.
    seen = so_far = ""
    for piece, out in zip(pieces, emitted):
        seen, so_far = seen + piece, so_far + out
        if not reference(seen, stops)[1]:
            assert len(seen) - len(so_far) < max(map(len, stops))
