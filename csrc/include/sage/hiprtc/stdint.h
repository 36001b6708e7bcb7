// <stdint.h> for the device half of a hiprtc build (passed to hiprtc as the named header
// "stdint.h"; hiprtc resolves no system header). hiprtc's pre-included runtime header already
// declares the 32- and 64-bit types (int64_t as long long, whose size and alignment match the
// host's long, so SageParams has one layout on both sides); the narrower ones are added here.
#pragma once
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
