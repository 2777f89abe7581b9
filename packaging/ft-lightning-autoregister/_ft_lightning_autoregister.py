"""Run at interpreter start-up by ft_lightning_autoregister.pth (PEP 829: the .start file on 3.15+).

It only installs ft_lightning's import hook: Lightning, torch and the strategy load when the user's
script imports Lightning, and then "fault_tolerant_ddp" is registered in its strategy registry.
Never raises: a broken or removed ft-lightning must not break every Python start-up.
"""


def install() -> None:
    try:
        from ft_lightning._registration import install as install_hook
    except Exception:  # noqa: BLE001 - ft-lightning missing or broken: leave start-up alone
        return
    install_hook()
