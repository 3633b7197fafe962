import os
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)


@pytest.fixture(scope="session")
def tmp_root(tmp_path_factory):
    "A folder for the reference runs, shared by the tests of one session."
    return str(tmp_path_factory.mktemp("runs"))
