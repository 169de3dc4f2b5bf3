"""Errors that mean "the user asked for something that cannot be done": the CLI prints them as
one line and exits with status 2, never with a traceback."""


class UsageError(Exception):
    """Bad input: the message names the problem and, where there is one, the fix."""


def closest_names(name: str, known: list[str] | tuple[str, ...], limit: int = 3) -> list[str]:
    """The known names closest to ``name``, best first (for "did you mean ...?")."""
    import difflib

    return difflib.get_close_matches(name, list(known), n=limit, cutoff=0.5)


def unknown_name_message(kind: str, name: str, known: list[str] | tuple[str, ...]) -> str:
    """``unknown family 'lama'; did you mean 'llama'? known: ...``"""
    guesses = closest_names(name, known)
    hint = f"; did you mean {' or '.join(repr(g) for g in guesses)}?" if guesses else ""
    return f"unknown {kind} {name!r}{hint} known: {', '.join(sorted(known))}"


# NOTE: torchrun stops every rank as soon as one exits non-zero, so a rank that leaves first can cut
# the main process off before it prints the message; the others leave this long after it.
COLLECTIVE_EXIT_DELAY_S = 2.0


def raise_on_every_rank(accelerator, message: str | None) -> None:
    """Raise :class:`UsageError` with ``message`` (already the same on every rank) when it is not
    None: at once on the main process, which prints it, a moment later on the others."""
    if not message:
        return
    if not accelerator.is_main_process:
        import time

        time.sleep(COLLECTIVE_EXIT_DELAY_S)
    raise UsageError(message)
