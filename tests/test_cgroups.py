"""Sandbox cgroups (`sandbox/cgroups.py`): where they go on cgroup v1 and v2, as a function of
the cgroup tree (fake trees: this test host mounts v1, most hosts are v2 only), and for real on
this host: one cgroup per sandbox shared by its concurrent commands, a leaf per command so a
timeout kills that command only, and nothing left once the last command ends."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from upstreams.scripted import wait_for

from codeplane.sandbox import BwrapRunner, Limits, cgroups
from codeplane.sandbox.cgroups import Layout, SandboxCgroup, find_layout, prepare

V2_SELF = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/codeplane.service\n"


def tree(root: Path, files: dict[str, str], owner: int | None = None) -> Path:
    """A fake cgroup mount: interface files are plain files."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
        if owner is not None:
            os.chown(root / name, owner, owner)
    return root


def test_v1_hierarchies_per_controller(tmp_path: Path) -> None:
    root = tree(tmp_path, {"memory/cgroup.procs": "", "pids/cgroup.procs": "",
                           "unified/cgroup.controllers": ""})  # systemd's empty v2 mount
    layout = find_layout(root, "", euid=0)
    assert layout.version == "v1" and not layout.enable and layout.vacate is None
    assert dict(layout.parents) == {"memory": root / "memory" / cgroups.PARENT,
                                    "pids": root / "pids" / cgroups.PARENT}


def test_v1_as_a_normal_user_needs_a_directory_given_to_it(tmp_path: Path) -> None:
    root = tree(tmp_path, {"memory/cgroup.procs": "", "pids/cgroup.procs": ""})
    assert find_layout(root, "", euid=4242).version == "none"
    (root / "pids" / cgroups.PARENT).mkdir()
    os.chown(root / "pids" / cgroups.PARENT, 4242, 4242)
    layout = find_layout(root, "", euid=4242)
    assert layout.controllers == ["pids"] and "no usable memory" in layout.note


def test_v2_as_root(tmp_path: Path) -> None:
    root = tree(tmp_path, {"cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma",
                           "cgroup.subtree_control": "memory", "cgroup.procs": ""})
    layout = find_layout(root, V2_SELF, euid=0)
    parent = root / cgroups.PARENT
    assert layout.version == "v2" and layout.dirs() == [parent]
    assert layout.enable == (root / "cgroup.subtree_control", parent / "cgroup.subtree_control")
    ready = prepare(layout)
    assert ready == layout
    assert (root / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (parent / "cgroup.subtree_control").read_text() == "+memory +pids"
    box = SandboxCgroup(64 << 20, 32, layout=ready)
    leaf = box.enter(1 << 30, 256)
    sandbox = parent / box.name
    assert leaf.leaves == [sandbox / leaf.leaves[0].name]
    assert (sandbox / "memory.max").read_text() == str(64 << 20)  # the sandbox's, not 1 GiB
    assert (sandbox / "pids.max").read_text() == "32"
    assert leaf.oom_file == sandbox / "memory.events"
    assert leaf.wrapper()[-2:] == [str(leaf.leaves[0]), "--"]


def test_v2_delegated_to_a_normal_user(tmp_path: Path) -> None:
    own = "user.slice/user-1000.slice/user@1000.service/app.slice/codeplane.service"
    root = tree(tmp_path, {"cgroup.controllers": "cpu io memory pids"})
    tree(root / own, {"cgroup.controllers": "memory pids", "cgroup.subtree_control": "",
                      "cgroup.procs": "4711\n"}, owner=4242)
    layout = find_layout(root, V2_SELF, euid=4242)
    top = root / own
    assert layout.version == "v2" and layout.vacate == top / cgroups.SERVER_LEAF
    assert layout.dirs() == [top / cgroups.PARENT]
    prepare(layout)  # the server leaves its cgroup first: v2 hands controllers to children
    assert (top / cgroups.SERVER_LEAF / "cgroup.procs").read_text() == str(os.getpid())
    assert (top / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_v2_not_delegated_or_without_controllers(tmp_path: Path) -> None:
    own = "user.slice/user-1000.slice/session-3.scope"
    root = tree(tmp_path, {"cgroup.controllers": "cpu memory pids"})
    tree(root / own, {"cgroup.controllers": "", "cgroup.subtree_control": "",
                      "cgroup.procs": ""})  # owned by root, as systemd leaves a session
    layout = find_layout(root, f"0::/{own}\n", euid=4242)
    assert layout.version == "none" and "not delegated" in layout.note
    bare = tree(tmp_path / "bare", {"cgroup.controllers": "cpu io"})
    assert find_layout(bare, "0::/\n", euid=0).version == "none"
    assert find_layout(tmp_path / "nothing", "", euid=0).version == "none"


def test_a_layout_that_cannot_be_set_up_is_none(tmp_path: Path) -> None:
    root = tree(tmp_path, {"cgroup.controllers": "memory pids"})
    (root / "cgroup.subtree_control").mkdir()  # writing it fails, as EBUSY would
    layout = prepare(find_layout(root, "0::/\n", euid=0))
    assert layout.version == "none" and "cannot be used" in layout.note


def test_dead_servers_cgroups_are_swept(tmp_path: Path) -> None:
    root = tree(tmp_path, {"memory/cgroup.procs": "", "pids/cgroup.procs": ""})
    parent = root / "pids" / cgroups.PARENT
    dead = parent / "sb-999999999-1-abcdef"
    (dead / "cmd-1").mkdir(parents=True)
    alive = SandboxCgroup(layout=find_layout(root, "", euid=0))
    (parent / alive.name).mkdir(parents=True)
    prepare(find_layout(root, "", euid=0))
    assert not dead.exists() and (parent / alive.name).exists()


# ---------------------------------------------------------------- for real on this host

@pytest.fixture
def layout() -> Layout:
    found = cgroups.current()
    if found.version == "none":
        pytest.skip(f"no usable cgroup here: {found.note}")
    return found


def test_describe_says_what_bounds_a_sandbox(layout: Layout) -> None:
    info = cgroups.describe()
    assert info["hierarchy"] == layout.version
    assert set(info["cgroups"]) == set(layout.controllers)
    assert info["memory"].startswith("per sandbox") == ("memory" in layout.controllers)


def test_one_cgroup_per_sandbox_and_none_left_after(layout: Layout, ws: Path) -> None:
    box = BwrapRunner(ws)
    sandbox = [d / box.cgroup.name for d in layout.dirs()]
    os.mkfifo(ws / "hold")
    release = os.open(ws / "hold", os.O_RDWR)

    def leaves() -> list[int]:
        return [sum(p.is_dir() for p in d.iterdir()) for d in sandbox if d.is_dir()]

    threads = [threading.Thread(target=lambda: box.run("read line < hold", ws, Limits()))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    try:  # both commands in the sandbox's cgroup, each in a leaf of its own
        wait_for(lambda: leaves() == [2] * len(sandbox), 60, "for two leaves")
    finally:
        os.write(release, b"\n\n")
        for thread in threads:
            thread.join()
        os.close(release)
    assert not any(d.exists() for d in sandbox)


def test_a_timeout_kills_its_command_only(layout: Layout, ws: Path) -> None:
    box = BwrapRunner(ws)
    os.mkfifo(ws / "hold")
    release = os.open(ws / "hold", os.O_RDWR)
    survivor: list = []
    other = threading.Thread(target=lambda: survivor.append(
        box.run(": > started; read line < hold; echo SURVIVED", ws, Limits())))
    other.start()
    try:
        wait_for(lambda: (ws / "started").exists(), 60, "for the first command")
        late = box.run("sleep 600", ws, Limits(timeout=1))
        assert late.killed == "timeout"
    finally:
        os.write(release, b"\n")
        other.join()
        os.close(release)
    assert survivor[0].exit_code == 0 and "SURVIVED" in survivor[0].output, survivor
