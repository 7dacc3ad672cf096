"""The ssh tier's session fixture: two nodes over real ssh on 127.0.0.1 (see nodes.py), up for
the session and stopped at its end; its dir (keys, configs, sshd's log) is pytest's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ssh.nodes import SshNodes


@pytest.fixture(scope="session")
def ssh_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshNodes]:
    nodes = SshNodes(tmp_path_factory.mktemp("ssh-nodes")).up()
    try:
        yield nodes
    finally:
        nodes.down()
