// mtl_traits.h: the few type traits the emulator's Metal prelude needs, written out so that
// kernels compile as freestanding C++ (-nostdinc++ -nostdlib++): no C++ standard library is
// included or linked, so no clang needs a prebuilt libc++ (zig's would build one on first use).
// Names follow <type_traits>; they live in `mtl_std` so they never meet a real `std`.
#pragma once
#pragma clang system_header  // warnings are the kernel's, not the prelude's

namespace mtl_std {

template <class T, T V>
struct integral_constant {
  static constexpr T value = V;
};
using true_type = integral_constant<bool, true>;
using false_type = integral_constant<bool, false>;

template <bool B, class T = void>
struct enable_if {};
template <class T>
struct enable_if<true, T> {
  using type = T;
};
template <bool B, class T = void>
using enable_if_t = typename enable_if<B, T>::type;

template <bool B, class T, class F>
struct conditional {
  using type = T;
};
template <class T, class F>
struct conditional<false, T, F> {
  using type = F;
};
template <bool B, class T, class F>
using conditional_t = typename conditional<B, T, F>::type;

template <class A, class B>
inline constexpr bool is_same_v = __is_same(A, B);

template <class T> struct remove_cv { using type = T; };
template <class T> struct remove_cv<const T> { using type = T; };
template <class T> struct remove_cv<volatile T> { using type = T; };
template <class T> struct remove_cv<const volatile T> { using type = T; };
template <class T>
using remove_cv_t = typename remove_cv<T>::type;

template <class T> struct remove_reference { using type = T; };
template <class T> struct remove_reference<T&> { using type = T; };
template <class T> struct remove_reference<T&&> { using type = T; };
template <class T>
using remove_reference_t = typename remove_reference<T>::type;

template <class T> struct remove_pointer { using type = T; };
template <class T> struct remove_pointer<T*> { using type = T; };
template <class T> struct remove_pointer<T* const> { using type = T; };
template <class T>
using remove_pointer_t = typename remove_pointer<T>::type;

template <class T> struct remove_extent { using type = T; };
template <class T> struct remove_extent<T[]> { using type = T; };
template <class T, unsigned long N> struct remove_extent<T[N]> { using type = T; };
template <class T>
using remove_extent_t = typename remove_extent<T>::type;

template <class T> inline constexpr bool is_array_v = false;
template <class T> inline constexpr bool is_array_v<T[]> = true;
template <class T, unsigned long N> inline constexpr bool is_array_v<T[N]> = true;

// decay: references and cv dropped, arrays become pointers (functions are not Metal)
template <class T>
struct decay {
  using U = remove_reference_t<T>;
  using type = conditional_t<is_array_v<U>, remove_extent_t<U>*, remove_cv_t<U>>;
};
template <class T>
using decay_t = typename decay<T>::type;

template <class T> struct is_integral_base : false_type {};
#define MTL_INTEGRAL(T) template <> struct is_integral_base<T> : true_type {};
MTL_INTEGRAL(bool)
MTL_INTEGRAL(char)
MTL_INTEGRAL(signed char)
MTL_INTEGRAL(unsigned char)
MTL_INTEGRAL(short)
MTL_INTEGRAL(unsigned short)
MTL_INTEGRAL(int)
MTL_INTEGRAL(unsigned int)
MTL_INTEGRAL(long)
MTL_INTEGRAL(unsigned long)
MTL_INTEGRAL(long long)
MTL_INTEGRAL(unsigned long long)
#undef MTL_INTEGRAL
template <class T>
inline constexpr bool is_integral_v = is_integral_base<remove_cv_t<T>>::value;
template <class T>
inline constexpr bool is_enum_v = __is_enum(T);
template <class From, class To>
inline constexpr bool is_convertible_v = __is_convertible_to(From, To);
template <class T>
inline constexpr bool is_signed_v = is_integral_v<T> && (remove_cv_t<T>)(-1) < (remove_cv_t<T>)0;

template <class T> struct make_unsigned { using type = T; };
template <> struct make_unsigned<char> { using type = unsigned char; };
template <> struct make_unsigned<signed char> { using type = unsigned char; };
template <> struct make_unsigned<short> { using type = unsigned short; };
template <> struct make_unsigned<int> { using type = unsigned int; };
template <> struct make_unsigned<long> { using type = unsigned long; };
template <> struct make_unsigned<long long> { using type = unsigned long long; };
template <class T>
using make_unsigned_t = typename make_unsigned<remove_cv_t<T>>::type;

template <class T>
T&& declval() noexcept;

template <class T>
constexpr T&& forward(remove_reference_t<T>& t) noexcept {
  return static_cast<T&&>(t);
}
template <class T>
constexpr T&& forward(remove_reference_t<T>&& t) noexcept {
  return static_cast<T&&>(t);
}

}  // namespace mtl_std
