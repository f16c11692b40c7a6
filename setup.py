"""Build hook: ship the top-level ``layer_specs/*.json`` model cards inside the package.

The cards stay at the repository's top level (``layer_specs/``); every build (wheel, sdist -> wheel,
editable) copies them to ``glm5_dsa_plugin/layer_specs/`` in the build tree, where
``glm5_dsa_plugin.checkpoints.cards`` finds them through ``importlib.resources``. Everything else is in
pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CARDS_SRC = Path(__file__).resolve().parent / "layer_specs"


class BuildPyWithCards(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads the checkout's layer_specs/ directly
            return
        cards = sorted(CARDS_SRC.glob("*.json"))
        if not cards:
            raise RuntimeError(f"no model cards in {CARDS_SRC}: the wheel would ship none")
        dst = Path(self.build_lib) / "glm5_dsa_plugin" / "layer_specs"
        dst.mkdir(parents=True, exist_ok=True)
        for card in cards:
            shutil.copyfile(card, dst / card.name)


setup(cmdclass={"build_py": BuildPyWithCards})
