//! A tiny llama model whose matrices are each of the block formats (Q4_0, Q4_1, Q5_0, Q5_1,
//! Q8_0, Q4_K, Q5_K, Q6_K, in turn) loads without requantization, its weights held in the
//! file's own bytes, and gives the logits of the same model with every matrix dequantized to
//! f32 by the f64 oracle.

use candle_core::Device;
use candle_core::quantized::{GgmlDType, QTensor, ggml_file, gguf_file};
use model::generate::argmax;
use model::int8gemm::PrefillActs;
use model::kv::{HeapChunks, KvCache, KvFormat};
use model::qmatrix::{Kind, oracle};
use model::tiny::{TinySpec, write_tiny_gguf};
use model::{Logits, Model};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

const FORMATS: [Kind; 8] = [
    Kind::Q4_K,
    Kind::Q5_K,
    Kind::Q6_K,
    Kind::Q4_0,
    Kind::Q5_0,
    Kind::Q5_1,
    Kind::Q4_1,
    Kind::Q8_0,
];

fn spec() -> TinySpec {
    TinySpec {
        hidden: 256,
        ffn: 512,
        n_heads: 4,
        n_kv_heads: 2,
        separate_output: true,
        formats: FORMATS.to_vec(),
        ..TinySpec::default()
    }
}

/// Rewrites the GGUF at `src` to `dst` with every block-format tensor dequantized to f32 by the
/// oracle (metadata unchanged).
fn dequantized_twin(src: &Path, dst: &Path) {
    let mut f = std::fs::File::open(src).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let mut tensors = Vec::new();
    for (name, info) in &ct.tensor_infos {
        let kind = Kind::from_ggml(info.ggml_dtype).expect("a block format");
        let n = info.shape.elem_count();
        let mut raw = vec![0u8; kind.bytes_of(n)];
        f.seek(SeekFrom::Start(ct.tensor_data_offset + info.offset))
            .unwrap();
        f.read_exact(&mut raw).unwrap();
        let mut w = vec![0.0f64; n];
        oracle::dequant(kind, &raw, &mut w);
        let bytes: Vec<u8> = w.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect();
        let t = ggml_file::qtensor_from_ggml(
            GgmlDType::F32,
            &bytes,
            info.shape.dims().to_vec(),
            &Device::Cpu,
        )
        .unwrap();
        tensors.push((name.clone(), t));
    }
    let md: Vec<(&str, &gguf_file::Value)> =
        ct.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(dst).unwrap();
    gguf_file::write(&mut out, &md, &ts).unwrap();
}

/// Every token's logits of a prefill, then those of a few greedy steps.
fn logits(model: &Model, prompt: &[u32]) -> Vec<f32> {
    let mut cache = KvCache::new(
        model.chunk_shape(16),
        KvFormat::F16,
        256,
        Box::new(HeapChunks::default()),
    );
    let mut all = model.forward(&mut cache, prompt, Logits::All).unwrap();
    let vocab = model.cfg.vocab;
    for _ in 0..3 {
        let t = argmax(&all[all.len() - vocab..]);
        all.extend(model.forward(&mut cache, &[t], Logits::Last).unwrap());
    }
    all
}

#[test]
fn every_block_format_loads_as_the_file_holds_it_and_gives_the_f32_logits() {
    let dir = tempfile::tempdir().unwrap();
    let (q, f) = (dir.path().join("q.gguf"), dir.path().join("f32.gguf"));
    write_tiny_gguf(&q, &spec()).unwrap();
    dequantized_twin(&q, &f);
    let quant = Model::load(&q).unwrap();
    let reference = Model::load(&f).unwrap();

    // Held as the file's blocks: the matrices' bytes are the file's (the norms, f32 in the
    // file, are held as vectors beside them).
    let held = quant.holding().resident_bytes as f64;
    let file = quant.file_tensor_bytes() as f64;
    assert!(
        held <= 1.15 * file,
        "held {held} bytes for {file} in the file"
    );
    let norms = ((2 * quant.cfg.n_layers + 1) * quant.cfg.hidden * 4) as f64;
    assert_eq!(held, file - norms, "every matrix held byte for byte");

    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 260).collect();
    let (a, b) = (logits(&quant, &prompt), logits(&reference, &prompt));
    assert_eq!(a.len(), b.len());
    // The two compute the same function of the same f32 weights and differ only in f32
    // rounding: each product within about (n / 16 + 64) u of its terms' magnitude (n ≤ 512,
    // u = 2^-24, so ≤ 6e-6 relative), through two layers whose norms and softmax amplify it
    // by at most a few hundred: 1e-3 of the logits' scale bounds it.
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-3 * scale,
            "logit {i}: {x} vs {y} (scale {scale})"
        );
    }
}

/// int8 prefill activations on every block format: each matrix's batched products take the
/// int8 path, the logits stay near the f32 model's (the activations' rounding, about 1/254 of
/// each block's largest value, through two layers), and a prompt prefilled in steps of any
/// size gives the same bits.
#[test]
fn every_block_format_prefills_with_int8_activations() {
    let dir = tempfile::tempdir().unwrap();
    let (q, f) = (dir.path().join("q.gguf"), dir.path().join("f32.gguf"));
    write_tiny_gguf(&q, &spec()).unwrap();
    dequantized_twin(&q, &f);
    let mut quant = Model::load(&q).unwrap();
    quant.set_prefill_activations(PrefillActs::Int8);
    let reference = Model::load(&f).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 260).collect();
    let cache = |m: &Model| {
        KvCache::new(
            m.chunk_shape(16),
            KvFormat::F16,
            256,
            Box::new(HeapChunks::default()),
        )
    };
    let (mut a, mut b) = (cache(&quant), cache(&reference));
    let got = quant.forward(&mut a, &prompt, Logits::All).unwrap();
    let want = reference.forward(&mut b, &prompt, Logits::All).unwrap();
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        worst <= 0.05 * scale,
        "max |dlogit| {worst} (scale {scale})"
    );
    let last = |pieces: &[usize]| {
        let mut c = cache(&quant);
        let mut at = 0;
        let mut out = Vec::new();
        for &n in pieces {
            out = quant
                .forward(&mut c, &prompt[at..at + n], Logits::Last)
                .unwrap();
            at += n;
        }
        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    };
    let whole = last(&[40]);
    assert_eq!(whole, last(&[16, 16, 8]));
    assert_eq!(whole, last(&[32, 8]));
}

/// A file whose tensor has a type no kernel reads and candle cannot parse fails once, naming
/// the file and the type, with nothing else repeated.
#[test]
fn an_unknown_tensor_type_is_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("odd.gguf");
    write_tiny_gguf(&path, &TinySpec::default()).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    // The tensor record after the name "output_norm.weight": dims count (u32), one u64 dim,
    // then the type (u32), patched to 20 (IQ4_NL).
    let name = b"output_norm.weight";
    let at = bytes
        .windows(name.len())
        .position(|w| w == name)
        .expect("the tensor's record");
    let ty = at + name.len() + 4 + 8;
    assert_eq!(bytes[ty..ty + 4], 0u32.to_le_bytes(), "an f32 tensor");
    bytes[ty..ty + 4].copy_from_slice(&20u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = Model::load(&path).err().expect("an error").to_string();
    assert!(
        err.contains("odd.gguf") && err.contains("ggml type 20,"),
        "{err}"
    );
    assert_eq!(err.matches("odd.gguf").count(), 1, "{err}");
    assert_eq!(err.matches("20").count(), 1, "{err}");
}

/// An architecture the engine does not run is said once, with the file, even when the whole
/// error chain is printed (as the CLI does).
#[test]
fn an_unknown_architecture_is_said_once_through_the_error_chain() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("other.gguf");
    write_tiny_gguf(&path, &TinySpec::default()).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    // The value of `general.architecture`: its type (u32, 8 = string), its length (u64), "llama".
    let key = b"general.architecture";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("the key")
        + key.len()
        + 4
        + 8;
    assert_eq!(&bytes[at..at + 5], b"llama");
    bytes[at..at + 5].copy_from_slice(b"gemmx");
    std::fs::write(&path, &bytes).unwrap();
    let err = Model::load(&path).err().expect("an error");
    let mut chain = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(s) = source {
        chain += &format!(": {s}");
        source = s.source();
    }
    assert!(chain.contains("other.gguf"), "{chain}");
    assert_eq!(
        chain
            .matches("unsupported model architecture \"gemmx\"")
            .count(),
        1,
        "{chain}"
    );
}
