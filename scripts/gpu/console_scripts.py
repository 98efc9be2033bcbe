"""Write the console scripts (vllm, vllm-router, ray, ...) of the unpacked GPU bundle.

``pip install --target`` on the build machine writes scripts whose first line names that
machine's interpreter, so prepare.sh drops them; this recreates them on the GPU machine from each
distribution's entry_points.txt, for the interpreter that runs this script.

Usage: console_scripts.py SITE_LIB BIN_DIR
"""

import configparser
import sys
from pathlib import Path

TEMPLATE = """#!{python}
import sys
if {lib!r} not in sys.path:
    sys.path.append({lib!r})
from {module} import {head}
if __name__ == "__main__":
    sys.exit({call}())
"""


def main(lib: Path, bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    made = []
    for entry_points in sorted(lib.glob("*.dist-info/entry_points.txt")):
        parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
        parser.optionxform = str  # type: ignore[assignment,method-assign]  # keep names' case
        parser.read(entry_points)
        if not parser.has_section("console_scripts"):
            continue
        for name, target in parser.items("console_scripts"):
            module, _, attr = target.strip().partition(":")
            attr = attr.split("[")[0].strip()
            script = bin_dir / name
            text = TEMPLATE.format(
                python=sys.executable, lib=str(lib), module=module, head=attr.split(".")[0], call=attr
            )
            script.write_text(text)
            script.chmod(0o755)
            made.append(name)
    print(f"console scripts in {bin_dir}: {' '.join(sorted(made))}")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]))
