"""Deployment to machines qtvm does not run on (ARM boards, phones).

``toolchain``  which C/C++ compiler links an artefact for the target's host triple
               (cross compilers found or named in the error), and the export that
               uses it (checked with readelf before the artefact is renamed into place)
``elf``        readelf-level facts and checks of an artefact: machine, dynamic deps,
               exported kernels, the qtvm metadata read from the embedded module
``native``     ``qtvm_run``, a C++ loader that runs an artefact with libtvm_runtime
               only (no Python on the device), built with the same cross compiler
"""
