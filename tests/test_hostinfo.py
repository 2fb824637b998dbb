from __future__ import annotations

from qtvm.hostinfo import cpu_identity, physical_cores

SMT = """processor\t: 0
physical id\t: 0
core id\t\t: 0

processor\t: 1
physical id\t: 0
core id\t\t: 1

processor\t: 2
physical id\t: 0
core id\t\t: 0

processor\t: 3
physical id\t: 0
core id\t\t: 1
"""


def test_hyperthreads_of_one_core_count_once():
    assert physical_cores(SMT, {0, 1, 2, 3}) == 2


def test_only_the_cpus_the_process_may_use_count():
    assert physical_cores(SMT, {0, 2}) == 1  # two hyperthreads of core 0
    assert physical_cores(SMT, {0, 1}) == 2


def test_without_topology_every_allowed_cpu_counts():
    assert physical_cores("processor\t: 0\n\nprocessor\t: 1\n", {0, 1}) == 2
    assert physical_cores("", {0, 1, 2}) == 3


def test_cpu_identity_names_vendor_family_model_and_stepping():
    """Two generations of Xeon VMs both call themselves 'Intel(R) Xeon(R) Processor'."""
    info = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\n"
            "model name\t: Intel(R) Xeon(R) Processor\nstepping\t: 2\n\n"
            "processor\t: 1\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 167\n")
    assert cpu_identity(info) == "GenuineIntel family 6 model 207 stepping 2"
    assert cpu_identity("") == "? family ? model ? stepping ?"
