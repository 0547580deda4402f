"""The tests of E2B's Python SDK suite that cannot pass against a self-hosted k3sys service, each
with the reason (docs/sandbox_e2b.md lists them). Keys are paths relative to the suite's `tests/`
folder with `sync_`/`async_` folded to `*` (one key covers both twins), optionally `::test` (a
trailing `*` there matches a prefix). Bugs of ours are not listed: they fail, visibly."""

from __future__ import annotations

import re

_INTERNET = ("needs the internet (https://connectivitycheck.gstatic.com, 1.1.1.1, 8.8.8.8) and curl; "
             "this machine reaches no internet and the base template has no curl")
_NETWORK = ("E2B's egress firewall (SandboxNetworkOpts: allow/deny lists, request transforms) is an E2B "
            "cloud feature, 422 here; its checks also need the internet (allowPublicTraffic is served: "
            "tests/sandbox/service/test_sandbox_ports.py)")
_HOST = ("reaches a sandbox port at https://<port>-<sandbox id>.<domain>: the service routes that host form "
         "itself (plain HTTP, tests/sandbox/service/test_sandbox_ports.py), TLS and wildcard DNS are a "
         "reverse proxy's (docs/sandbox_e2b.md, \"Ports\"), which the runner does not set up")
_REBOOT = ("proves the cold start by a new /proc/sys/kernel/random/boot_id; a container shares the host's "
           "kernel, whose boot id never changes (E2B's VM boots its own)")
_STACK = ("version mismatch: the test (2.45) mocks request_build without min_free_disk_mb, which the 2.63.0 "
          "wheel passes: a TypeError, not the mocked step's trace")
_UBUNTU = ("builds from_image('ubuntu:22.04'), pulled from Docker Hub: this machine reaches no registry "
           "(from_base_image() and from_template('base') build here: docs/templates.md)")
_TAGS = "template tags (name:tag, assign/remove tags) are refused by name: a template is its one build here"

CANNOT_PASS: dict[str, str] = {
    "*/sandbox_*/test_internet_access.py::test_internet_access_enabled": _INTERNET,
    "*/sandbox_*/test_internet_access.py::test_internet_access_default": _INTERNET,
    "*/sandbox_*/test_network.py": _NETWORK,
    "*/sandbox_*/test_host.py": _HOST,
    "*/sandbox_*/test_create.py::test_auto_resume_wakes_on_http_request": _HOST,
    "*/sandbox_*/test_create.py::test_mcp_gateway_start_failure_kills_created_sandbox":
        "the MCP gateway is an E2B cloud feature (422 here)",
    "*/sandbox_*/test_config_propagation.py::test_connect_sets_stable_host_routing_headers":
        "asserts the cloud's envd URL https://sandbox.e2b.app, which E2B_SANDBOX_URL (needed to reach a "
        "self-hosted service) replaces",
    "*/sandbox_*/test_connect.py::test_connect_normalizes_unset_tokens":
        "version mismatch: the test mocks post_sandboxes_sandbox_id_connect, the 2.63.0 wheel calls "
        "post_v2_sandboxes_sandbox_id_connect, so a real request with the placeholder key gets 401",
    "*/sandbox_*/files/test_info.py::test_file_symlink":
        "version mismatch: the test (2.45) expects a symlink's get_info type to be its target's (FILE); the "
        "2.63.0 wheel reports FileType.SYMLINK for any entry envd marks is_symlink (map_entry_info), as ours is",
    "*/sandbox_*/commands/test_env_vars.py::test_bash_command_scoped_env_vars":
        "runs `sudo`: E2B's base gives `user` password-less sudo; our sandboxes run with no_new_privileges "
        "(no setuid elevation, by design), so root is asked for with user='root'",
    "*/sandbox_*/test_snapshot_filesystem_only.py::test_pause_filesystem_only": _REBOOT,
    "*/sandbox_*/test_create.py::test_auto_pause_filesystem_only_reboots": _REBOOT,
    "*/template_*/test_build.py::test_build_template_with_*": _UBUNTU,
    "*/template_*/test_background_build.py": _UBUNTU + "; and its name has a tag (`e2b-test:v1-...`): " + _TAGS,
    "*/template_*/methods/test_make_symlink.py": _UBUNTU,
    "*/template_*/methods/test_run_cmd.py": _UBUNTU,
    "*/template_*/test_tags.py::TestTagsIntegration::*": _TAGS,
}

# test_stacktrace mocks the build API (nothing reaches the service); its mock of `request_build` (2.45)
# lacks `min_free_disk_mb`, which the 2.63.0 wheel passes, so each build ends in a TypeError whose
# traceback is not the step's (its tests that build nothing pass).
_TRACES = ("apt_install", "bun_install", "copy", "copyItems", "dev_container_prebuild", "from_aws_registry",
           "from_dockerfile", "from_gcp_registry", "from_image", "from_image_registry", "from_template", "git_clone",
           "make_dir", "make_symlink", "npm_install", "pip_install", "remove", "rename", "run_cmd",
           "second_item_of_copy_items", "second_source_of_multi_source_copy", "set_dev_container_start",
           "set_start_cmd", "set_user", "set_workdir", "start_cmd", "step_after_copy_items",
           "step_after_multi_source_copy")
CANNOT_PASS |= {f"*/template_*/test_stacktrace.py::test_traces_on_{t}": _STACK for t in _TRACES}


def cannot_pass(nodeid: str) -> str:
    """Why the test `nodeid` cannot pass here; '' if it should."""
    path, _, test = nodeid.partition("::")
    rel = re.sub(r"^(sync|async)/([a-z]+)_(sync|async)/", r"*/\2_*/", path.split("tests/", 1)[-1])
    test = test.split("[")[0]
    for key, why in CANNOT_PASS.items():
        kpath, _, ktest = key.partition("::")
        if kpath == rel and (not ktest or ktest == test or (ktest.endswith("*") and test.startswith(ktest[:-1]))):
            return why
    return ""
