"""Puts the start-up files (.pth, and PEP 829's .start) at the root of the wheel, i.e. directly in
site-packages, where the interpreter reads them. Everything else is in pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

STARTUP_FILES = ("ft_lightning_autoregister.pth", "ft_lightning_autoregister.start")
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithStartupFiles(build_py):
    def run(self) -> None:
        super().run()
        for name in STARTUP_FILES:
            self.copy_file(os.path.join(HERE, name), os.path.join(self.build_lib, name))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, n) for n in STARTUP_FILES]


setup(cmdclass={"build_py": BuildPyWithStartupFiles})
