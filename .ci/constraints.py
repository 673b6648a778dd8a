"""Print the installed versions of videosft's dependencies, extras included, as pip constraints.

After the test suite passed in an environment, record what it passed with:

    python .ci/constraints.py test > constraints.txt

`.ci/run` installs with these pins (`pip install -c constraints.txt -e '.[test]'`), so CI tests the
versions last verified; without `-c` pip takes the newest releases the bounds in pyproject.toml allow.
"""

from __future__ import annotations

import importlib.metadata
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(name: str, extras: list[str]) -> dict[str, str]:
    """Installed version of every distribution ``name[extras]`` needs, directly or not."""
    versions: dict[str, str] = {}
    todo = [(name, tuple(extras))]
    while todo:
        dist_name, dist_extras = todo.pop()
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:  # a requirement for another platform
            continue
        versions[canonicalize_name(dist_name)] = dist.version
        environments = [{"extra": extra} for extra in dist_extras] or [{"extra": ""}]
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker and not any(requirement.marker.evaluate(env) for env in environments):
                continue
            if canonicalize_name(requirement.name) not in versions:
                todo.append((requirement.name, tuple(requirement.extras)))
    return versions


if __name__ == "__main__":
    pins = closure("videosft", sys.argv[1:])
    pins.pop("videosft")
    print(f"# videosft[{','.join(sys.argv[1:])}] as last verified on Python {sys.version.split()[0]}, "
          f"written by .ci/constraints.py")
    print("\n".join(f"{name}=={version}" for name, version in sorted(pins.items())))
