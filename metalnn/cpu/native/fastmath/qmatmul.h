// Registers metalnn's affine-quantized product and dequantize primitives
// (qmatmul.cpp) in the module.
#pragma once

#include <nanobind/nanobind.h>

void register_qmatmul(nanobind::module_& m);
