// Registers the gated delta rule's native recurrence (gated_delta.cpp) in the module.
#pragma once

#include <nanobind/nanobind.h>

void register_gated_delta(nanobind::module_& m);
