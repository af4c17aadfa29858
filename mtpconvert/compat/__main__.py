"""``python -m mtpconvert.compat DIR... [--json]``: the runtime table of each folder."""

import json
import sys
from pathlib import Path

from . import check_folder, render

if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--json"]
    for a in args:
        rep = check_folder(Path(a))
        print(json.dumps(rep.to_json(), indent=2) if "--json" in sys.argv else render(rep))
