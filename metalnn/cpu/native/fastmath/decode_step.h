// Registers the fused decoder-block step (decode_step.cpp) in the module.
#pragma once

#include <nanobind/nanobind.h>

void register_decode_step(nanobind::module_& m);
