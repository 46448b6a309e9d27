"""Build hook: ship ``eagle3_compat_inherit.pth`` at the top of the wheel.

Everything else is in pyproject.toml.  The ``.pth`` line runs at interpreter
start and does nothing unless ``EAGLE3_COMPAT_APPLIED`` is set (see
``src/eagle3_compat/_inherit.py``).
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "eagle3_compat_inherit.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("src", PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
