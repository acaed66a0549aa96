"""Reading the EPLB JSON files (placements, load dumps): any failure is a UserError naming the file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepseek_pd.errors import UserError


def read_json(path: str | Path, what: str) -> Any:
    """The parsed content of `path`; `what` names the file's role in the error (e.g. "expert-load dump")."""
    file = Path(path)
    try:
        return json.loads(file.read_text())
    except OSError as exc:
        raise UserError(f"{what} {str(file)!r}: cannot read it ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{what} {file}: not valid JSON ({exc})") from None
