// Registers metalnn's products with GGML-packed weights and their dequantize primitive (ggml.cpp)
// in the module.
#pragma once

#include <nanobind/nanobind.h>

void register_ggml(nanobind::module_& m);
