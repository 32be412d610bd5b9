//! Which kernel runs each product on this CPU, as chosen at run time ([`Isa::best`],
//! [`Path::best`], both within `LLMS_ISA`), named for benchmark reports.

use crate::int8gemm::{Path, PrefillActs};
use crate::qmatrix::{Activations, Isa};

/// One product and the kernel that runs it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Chosen {
    /// What is computed.
    pub product: &'static str,
    /// The kernel that computes it here.
    pub kernel: &'static str,
}

/// The kernels of the single-token (decode) products with `decode` their activations, and of
/// the batched products with `prefill` theirs, as the model resolved them.
pub fn engine(decode: Activations, prefill: PrefillActs) -> Vec<Chosen> {
    let isa = Isa::best();
    #[cfg(target_arch = "x86_64")]
    let vnni = isa == Isa::Avx512 && crate::simd::vnni::available();
    #[cfg(not(target_arch = "x86_64"))]
    let vnni = false;
    let int8_rows = "vnni::matvec_q4_1/q8_0 (int8 activations), 4 rows per pass, vpdpbusd 512-bit";
    let mut out = vec![Chosen {
        product: "decode Q4_1/Q8_0 matvec",
        kernel: match (decode, isa) {
            (Activations::Int16 | Activations::Auto, _) if vnni => {
                "vnni::matvec_q4_1/q8_0 (16-bit activations: codes and remainders), 4 rows per \
                 pass, vpdpbusd 512-bit twice"
            }
            (Activations::Int8, _) if vnni => int8_rows,
            (Activations::Int16 | Activations::Auto, Isa::Avx2 | Isa::Avx512) => {
                "avx2::split_int8::matvec_q4_1/q8_0 (16-bit activations as words: 256 code + \
                 remainder), 4 rows per pass, weights widened to words, vpmaddwd 256-bit"
            }
            (Activations::Int8, Isa::Portable) => "portable, int8 activations, one row at a time",
            (Activations::Int8, _) => {
                "avx2::split_int8::matvec_q4_1/q8_0 (int8 activations), 4 rows per pass, \
                 vpmaddubsw 256-bit"
            }
            (_, Isa::Avx512) => {
                "avx512::matvec_q4_1/q8_0 (f32 activations), 4 rows per pass, 512-bit"
            }
            (_, Isa::Avx2) => {
                "avx2::matvec::matvec_q4_1/q8_0 (f32 activations), 4 rows per pass, 256-bit"
            }
            (_, Isa::Portable) => "portable (f32 activations), one row at a time",
        },
    }];
    out.push(Chosen {
        product: "decode Q4_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K matvec",
        kernel: match (decode, isa) {
            (Activations::Int8 | Activations::Auto, _) if vnni => {
                "vnni::blocks::matvec, file's blocks (int8 activations), 4 rows per pass, \
                 vpdpbusd 512-bit"
            }
            (Activations::Int8 | Activations::Auto, Isa::Avx2 | Isa::Avx512) => {
                "avx2::blocks_int8::matvec, file's blocks (int8 activations), 4 rows per pass, \
                 vpmaddubsw 256-bit"
            }
            (Activations::Int8, _) => "portable, int8 activations, one row at a time",
            (_, Isa::Avx512) => {
                "blocks::matvec, file's blocks (f32 activations), 4 rows per pass, 512-bit \
                 (Q4_K, Q5_0: codes widened from memory, one scale per 32)"
            }
            (_, Isa::Avx2) => {
                "blocks::matvec, file's blocks (f32 activations), 4 rows per pass, 256-bit"
            }
            (_, Isa::Portable) => "portable (f32 activations), one row at a time",
        },
    });
    out.push(Chosen {
        product: "prefill products, every block format (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K)",
        kernel: match (prefill.resolve(), Path::best()) {
            (PrefillActs::Int8, Path::Vnni) => {
                "int8 panels of the file's codes, vpdpbusd 512-bit (AVX-512 VNNI)"
            }
            (PrefillActs::Int8, Path::AvxVnni) => {
                "int8 panels of the file's codes, vpdpbusd 256-bit (AVX-VNNI)"
            }
            (PrefillActs::Int8, Path::Avx2) => {
                "int8 panels of the file's codes, vpmaddubsw+vpmaddwd 256-bit (AVX2)"
            }
            (PrefillActs::Int8, _) => "int8 panels of the file's codes, portable",
            _ if isa.has_avx2() => "f32 GEMM (gemm crate) over AVX2-dequantized tiles",
            _ => "f32 GEMM (gemm crate) over portably dequantized tiles",
        },
    });
    out.extend(attention());
    out
}

/// The kernels of decode attention over the KV chunks.
pub fn attention() -> Vec<Chosen> {
    let isa = Isa::best();
    let pick = |wide: &'static str, avx2: &'static str, portable: &'static str| match isa {
        Isa::Avx512 => wide,
        Isa::Avx2 => avx2,
        Isa::Portable => portable,
    };
    #[cfg(target_arch = "x86_64")]
    let vbmi = crate::simd::avx512::kv::has_vbmi();
    #[cfg(not(target_arch = "x86_64"))]
    let vbmi = false;
    let wide = if vbmi {
        "avx512::kv::dot_rows_stored/axpy_rows_stored, 3 query rows, 4 keys per pass (4-bit keys unpacked 64 at a time; 2- and 3-bit codes 64 at a time by VBMI byte permutes), 16 lanes"
    } else {
        "avx512::kv::dot_rows_stored/axpy_rows_stored, 3 query rows, 4 keys per pass (4-bit keys unpacked 64 at a time), 16 lanes"
    };
    vec![
        Chosen {
            product: "attention over unsigned codes (LLMS_KV_ARITH)",
            kernel: crate::kernels::coded::KvArith::describe(),
        },
        Chosen {
            product: "attention scores and value sums over f16/int8/packed codes",
            kernel: pick(
                wide,
                "avx2::kv::dot_rows_stored/axpy_rows_stored, 3 query rows, 8 lanes",
                "portable, codes unpacked per key",
            ),
        },
        Chosen {
            product: "KV code and coded-parameter decode",
            kernel: pick(
                "avx512::kv::decode_codes/decode_coded_params, 16 at a time",
                "avx2::kv::decode_codes/decode_coded_params, 8 at a time",
                "portable",
            ),
        },
        Chosen {
            product: "f32 key dot products and value sums",
            kernel: pick(
                "avx512::kv::dot_rows/axpy_rows, 16 keys per pass",
                "avx2::kv::dot_rows/axpy_rows, 8 keys per pass",
                "portable",
            ),
        },
        Chosen {
            product: "softmax",
            kernel: pick(
                "avx512::softmax/softmax_exp (polynomial e^x), 16 lanes",
                "avx2::softmax/softmax_exp (polynomial e^x), 8 lanes",
                "portable",
            ),
        },
        Chosen {
            product: "SwiGLU, GeGLU",
            kernel: if isa.has_avx2() {
                "avx2::swiglu/geglu (polynomial e^x)"
            } else {
                "portable"
            },
        },
    ]
}
