// Registers metalnn's fused training primitives (train_ops.cpp) in the module.
#pragma once

#include <nanobind/nanobind.h>

void register_train_ops(nanobind::module_& m);
