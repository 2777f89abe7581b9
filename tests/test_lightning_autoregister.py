"""The opt-in ft-lightning-autoregister distribution: installed into a fresh virtual environment, it makes
`Trainer(strategy="fault_tolerant_ddp")` and `Fabric(strategy="fault_tolerant_ddp")` work in a new
process whose script never imports ft_lightning."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv

import pytest
from conftest import REPO_ROOT, child_env

PACKAGE = f"{REPO_ROOT}/packaging/ft-lightning-autoregister"

USER_SCRIPT = textwrap.dedent("""
    import sys
    # start-up ran the .pth: the hook is in, nothing heavy was imported
    assert "ft_lightning" in sys.modules and "torch" not in sys.modules and "lightning" not in sys.modules
    import torch
    torch.set_num_threads(1)
    import lightning.pytorch as pl
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)

    trainer = pl.Trainer(strategy="fault_tolerant_ddp", accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny())
    print("trainer", type(trainer.strategy).__name__, trainer.global_step, trainer.strategy.manager.current_step())
    print("fabric", type(Fabric(strategy="fault_tolerant_ddp", accelerator="cpu", devices=1).strategy).__name__)
    import pytorch_lightning as ptl  # the standalone package has its own registry: registered too
    strategy = ptl.Trainer(strategy="fault_tolerant_ddp", accelerator="cpu", devices=1, logger=False).strategy
    print("pytorch_lightning", type(strategy).__module__)
""")


@pytest.mark.timeout(120)
def test_autoregister_makes_the_name_work_without_import(processes, tmp_path):
    from ft_core.control.lighthouse import LighthouseServer

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the fresh environment sees this repository and our venv's packages, but none of their .pth files
    with open(f"{site}/_ft_test_paths.pth", "w") as f:
        f.write(f"{REPO_ROOT}\n{sysconfig.get_path('purelib')}\n")

    source = tmp_path / "src"
    shutil.copytree(PACKAGE, source)  # the build writes into its source tree: keep the repository clean
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                              "--no-deps", "--no-build-isolation", "--no-index", str(source)],
                             capture_output=True, text=True, timeout=90, check=False)
    assert install.returncode == 0, install.stdout + install.stderr
    assert os.path.exists(f"{site}/ft_lightning_autoregister.pth"), "the .pth must land in site-packages"

    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT)
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=1, http_bind=None) as lighthouse:
        env = child_env(FT_LIGHTHOUSE=lighthouse.address(), PYTHONWARNINGS="ignore")
        env.pop("PYTHONPATH", None)  # only the environment's own site-packages
        proc = processes.spawn([str(python), str(script)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, cwd=str(tmp_path))
        out, _ = proc.communicate(timeout=100)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    assert "trainer FaultTolerantDDPStrategy 2 2" in text, text
    assert "fabric FaultTolerantFabricDDPStrategy" in text, text
    assert "pytorch_lightning ft_lightning.pytorch_lightning" in text, text
