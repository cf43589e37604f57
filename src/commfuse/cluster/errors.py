"""Errors of the cluster layer: each names the rank, its host and what it raised."""

from __future__ import annotations


class LaunchError(RuntimeError):
    """A job could not start, or a rank failed; the message names the rank and its error."""


class RankError(RuntimeError):
    """A function raised on one rank; carries that rank's exception and remote traceback.

    ``exc`` is the original exception when it could travel back (it was picklable), so callers
    can test its type: ``isinstance(err.exc, CommTimeoutError)``.
    """

    def __init__(
        self,
        rank: int,
        message: str,
        *,
        remote_traceback: str = "",
        exc: BaseException | None = None,
    ) -> None:
        super().__init__(
            f"rank {rank}: {message}"
            + (
                f"\n--- traceback on rank {rank} ---\n{remote_traceback}"
                if remote_traceback
                else ""
            )
        )
        self.rank = rank
        self.message = message
        self.remote_traceback = remote_traceback
        self.exc = exc
        self.partial_results: dict[int, object] = {}
        """What the ranks that did not fail returned (filled by the test pool)."""


class DeadlineExceeded(RuntimeError):
    """Ranks did not finish within the deadline; names them and what they were running."""

    def __init__(self, message: str, *, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks
