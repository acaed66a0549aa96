"""Errors shared across the project."""


class UserError(Exception):
    """Bad input a user can fix: a flag, a config field, a prompt. The message names what is wrong.

    The CLI prints it as one line; the gRPC servicers map it to INVALID_ARGUMENT.
    """


class CheckpointError(UserError):
    """A checkpoint that does not match the config: lists every missing and unexpected tensor."""

    def __init__(self, missing: list[str], unexpected: list[str], where: str = "") -> None:
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        parts = []
        if self.missing:
            parts.append(f"missing tensors ({len(self.missing)}): {', '.join(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected tensors ({len(self.unexpected)}): {', '.join(self.unexpected)}")
        prefix = f"{where}: " if where else ""
        super().__init__(prefix + "; ".join(parts))
