// The members every MLX primitive of this extension declares the same way, written once.
//
// mlx/primitives.h has DEFINE_NAME, DEFINE_DEFAULT_IS_EQUIVALENT and DEFINE_INPUT_OUTPUT_SHAPE for
// the same job, but they only compile inside namespace mlx::core (they name its types
// unqualified), the name is always the class name and the default is_equivalent compares no
// fields. These take the name as an expression and compare the fields they are given.
#pragma once

#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "mlx/primitives.h"

// In the body of a primitive class, defines
//   name()           returning NAME (any const char* expression; it may read the fields),
//   state()          the listed FIELDS as a tuple of const references, and
//   is_equivalent()  true for another primitive of the same class whose FIELDS all compare equal.
//
// mx.compile merges two nodes of one primitive class that read the same inputs when
// is_equivalent() says so, whatever their shapes: FIELDS must list every member that changes
// what the primitive computes (none for a primitive without parameters), and a struct field
// needs an operator== that compares all of its members.
#define METALNN_PRIMITIVE(NAME, ...)                                                             \
  const char* name() const override {                                                            \
    return NAME;                                                                                 \
  }                                                                                              \
  auto state() const {                                                                           \
    return std::tie(__VA_ARGS__);                                                                \
  }                                                                                              \
  bool is_equivalent(const ::mlx::core::Primitive& other) const override {                       \
    using Self = std::remove_cvref_t<decltype(*this)>;                                           \
    return typeid(other) == typeid(*this) && static_cast<const Self&>(other).state() == state(); \
  }

// output_shapes() of a primitive whose N_OUT outputs all have the shape of inputs[INPUT].
#define METALNN_OUTPUTS_SHAPED_LIKE_INPUT(INPUT, N_OUT)                                          \
  std::vector<::mlx::core::Shape> output_shapes(const std::vector<::mlx::core::array>& inputs)   \
      override {                                                                                 \
    return std::vector<::mlx::core::Shape>(N_OUT, inputs[INPUT].shape());                        \
  }
