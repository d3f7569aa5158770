use tch::{Device, Kind, Tensor};

use super::*;

/// An independent fp8 encoder: round to nearest, ties to even, of a value already within
/// the format's range (the cast clamps first), as the OCP FP8 spec defines it.
fn encode(v: f32, format: Fp8Format) -> u8 {
    let (mantissa_bits, bias) = match format {
        Fp8Format::E4m3 => (3i32, 7i32),
        Fp8Format::E5m2 => (2, 15),
    };
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = f64::from(v.abs());
    if a == 0.0 {
        return sign;
    }
    let min_exponent = 1 - bias;
    let mut e = (a.log2().floor() as i32).max(min_exponent);
    // log2 may round across a binade boundary; settle e so that 2^e <= a < 2^(e+1).
    while e > min_exponent && a < 2f64.powi(e) {
        e -= 1;
    }
    while a >= 2f64.powi(e + 1) {
        e += 1;
    }
    let quantum = 2f64.powi(e - mantissa_bits);
    let n = a / quantum;
    let mut r = n.round();
    if (n - n.floor() - 0.5).abs() == 0.0 && r % 2.0 != 0.0 {
        r -= 1.0; // a tie: to even
    }
    let implicit = f64::from(1 << mantissa_bits);
    if r >= 2.0 * implicit {
        e += 1;
        r = implicit;
    }
    let bits = if r >= implicit {
        (((e + bias) as u8) << mantissa_bits) | (r - implicit) as u8
    } else {
        r as u8 // subnormal (exponent field 0)
    };
    sign | bits
}

fn bits_of(t: &Tensor) -> Vec<u8> {
    Vec::<u8>::try_from(t.view_dtype(Kind::Uint8).flatten(0, -1)).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).flatten(0, -1)).unwrap()
}

/// Normal values with a few outliers, so that both saturation and subnormals occur.
fn sample(rows: i64, cols: i64, seed: i64) -> Tensor {
    tch::manual_seed(seed);
    let x = Tensor::randn([rows, cols], (Kind::Float, Device::Cpu));
    let _ = x.get(0).get(0).fill_(37.5);
    let _ = x.get(1).get(2).fill_(-1e-7);
    x
}

#[test]
fn casts_and_scales_equal_an_independent_encoder_bit_for_bit() {
    for format in [Fp8Format::E4m3, Fp8Format::E5m2] {
        let x = sample(24, 40, 3);
        let scaled = cast(&x, format, Granularity::Tensor, false).unwrap();
        // The scale: max / amax in f64, then to f32.
        let amax = values(&x).iter().fold(0f32, |m, v| m.max(v.abs()));
        let expected_scale = (format.max() / f64::from(amax).max(1e-12)) as f32;
        assert_eq!(scaled.scale.dim(), 0);
        assert_eq!(f32::try_from(&scaled.scale).unwrap().to_bits(), expected_scale.to_bits());
        let max = format.max() as f32;
        let expected: Vec<u8> = values(&x)
            .iter()
            .map(|v| encode((v * expected_scale).clamp(-max, max), format))
            .collect();
        assert_eq!(bits_of(&scaled.bits), expected, "{format:?}");

        // Row-wise: one scale per row, rounded down to a power of two.
        let rows = cast(&x, format, Granularity::Axis(-1), true).unwrap();
        assert_eq!(rows.scale.size(), [24, 1]);
        let xs = values(&x);
        let scales = values(&rows.scale);
        let bits = bits_of(&rows.bits);
        for (r, &s) in scales.iter().enumerate() {
            let row = &xs[r * 40..(r + 1) * 40];
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let exact = (format.max() / f64::from(amax)) as f32;
            assert!(s.to_bits() & 0x007f_ffff == 0 && s <= exact && s > exact / 2.0, "row {r}");
            for (c, v) in row.iter().enumerate() {
                assert_eq!(bits[r * 40 + c], encode((v * s).clamp(-max, max), format));
            }
        }
    }
}

#[test]
fn saturation_and_zeros_are_finite() {
    // All zeros: the scale comes from EPS instead of dividing by zero.
    let zeros = Tensor::zeros([4, 16], (Kind::Float, Device::Cpu));
    let s = cast(&zeros, Fp8Format::E4m3, Granularity::Tensor, false).unwrap();
    assert_eq!(f32::try_from(&s.scale).unwrap(), (448.0 / 1e-12) as f32);
    assert!(bits_of(&s.bits).iter().all(|&b| b == 0));
    // The largest magnitude lands exactly on the format's maximum.
    let x = Tensor::from_slice(&[-3.0f32, 1.0, 0.5]).reshape([1, 3]);
    let s = cast(&x, Fp8Format::E5m2, Granularity::Tensor, false).unwrap();
    assert_eq!(values(&s.bits.to_kind(Kind::Float))[0], -57344.0);
    assert_eq!(values(&s.dequantize(Kind::Float).unwrap())[0], -3.0);
}

#[test]
fn fp8_linear_is_near_the_exact_product_and_its_gradients_reach_input_and_weight() {
    for recipe in [Fp8Recipe::Tensorwise, Fp8Recipe::Rowwise] {
        let x = sample(32, 48, 1).set_requires_grad(true);
        let w = (sample(16, 48, 2) / 7.0).set_requires_grad(true);
        let b = Tensor::randn([16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let y = linear(&x, &w, Some(&b), recipe).unwrap();
        let exact = x.linear(&w, Some(&b));
        let rel =
            |a: &Tensor, e: &Tensor| (a - e).norm().double_value(&[]) / e.norm().double_value(&[]);
        let err = rel(&y, &exact);
        assert!(err > 0.0 && err < 0.1, "{recipe:?}: relative error {err}");

        let gy = sample(32, 16, 4);
        let (gx, gw, gb) = {
            let g = Tensor::run_backward(&[&y], &[&x, &w, &b], false, false);
            (g[0].shallow_clone(), g[1].shallow_clone(), g[2].shallow_clone())
        };
        let _ = gy;
        let ones = Tensor::ones([32, 16], (Kind::Float, Device::Cpu));
        let exact_gx = ones.mm(&w.detach());
        let exact_gw = ones.tr().mm(&x.detach());
        assert!(rel(&gx, &exact_gx) < 0.15, "{recipe:?}: grad input {}", rel(&gx, &exact_gx));
        assert!(rel(&gw, &exact_gw) < 0.15, "{recipe:?}: grad weight {}", rel(&gw, &exact_gw));
        assert!(rel(&gx, &exact_gx) > 0.0 && rel(&gw, &exact_gw) > 0.0);
        assert_eq!(values(&gb), vec![32.0; 16]);
        assert_eq!((gx.kind(), gw.kind()), (Kind::Float, Kind::Float));
    }
}

#[test]
fn layers_of_unsuitable_shapes_and_other_precisions_stay_plain_linear() {
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let plain = tch::nn::linear(vs.root() / "a", 10, 32, Default::default());
    let exact = Tensor::randn([4, 10], (Kind::Float, Device::Cpu));
    let expected = exact.linear(&plain.ws, plain.bs.as_ref());
    let layers = Fp8Layers::new(Fp8Recipe::Tensorwise);
    let switch = layers.register(&(vs.root() / "a"), &plain.ws).unwrap();
    let odd = Float8Linear::with_switch(plain, Fp8Recipe::Tensorwise, switch);
    assert_eq!(odd.fp8_recipe(), None, "10 inputs are not a multiple of 16");
    assert!(odd.try_forward(&exact).unwrap().equal(&expected));
    let fits = tch::nn::linear(vs.root() / "b", 16, 32, Default::default());
    let switch = layers.register(&(vs.root() / "b"), &fits.ws).unwrap();
    let fits = Float8Linear::with_switch(fits, Fp8Recipe::Tensorwise, switch);
    assert_eq!(fits.fp8_recipe(), Some(Fp8Recipe::Tensorwise));
    let paths: Vec<String> = layers
        .among(&[crate::shim::tensor_id(&fits.ws).unwrap()])
        .into_iter()
        .map(|l| l.path)
        .collect();
    assert_eq!(paths, ["b"]);
}

#[test]
fn evaluation_under_no_grad_needs_no_hooks() {
    let x = sample(8, 32, 5);
    let w = sample(16, 32, 6).set_requires_grad(true);
    let y = tch::no_grad(|| linear(&x, &w, None, Fp8Recipe::Tensorwise)).unwrap();
    assert!(!y.requires_grad());
    let with_grad = linear(&x, &w, None, Fp8Recipe::Tensorwise).unwrap();
    assert!(with_grad.requires_grad() && with_grad.detach().equal(&y));
}

/// CUDA's `_scaled_mm` needs the inner dimension (the tokens, in the weight gradient's
/// matmul) to be a multiple of 16; the same rule holds here, and 21 tokens are padded with
/// zero tokens: the weight gradient equals that of the same tokens plus 11 zero rows, whose
/// scales and sums are the same, and the input gradient is unaffected.
#[test]
fn a_token_count_that_is_no_multiple_of_16_pads_the_weight_gradients_matmul() {
    let odd = cast(&sample(16, 21, 7), Fp8Format::E4m3, Granularity::Tensor, false).unwrap();
    let other = cast(&sample(21, 16, 8), Fp8Format::E4m3, Granularity::Tensor, false).unwrap();
    let err = scaled_mm(&odd, &other, Kind::Float, false, false).unwrap_err().to_string();
    assert!(err.contains("multiples of 16"), "{err}");
    for recipe in [Fp8Recipe::Tensorwise, Fp8Recipe::Rowwise] {
        let x = sample(21, 32, 9);
        let w = (sample(16, 32, 10) / 7.0).set_requires_grad(true);
        let y = linear(&x, &w, None, recipe).unwrap();
        let gw = Tensor::run_backward(&[&y], &[&w], false, false)[0].shallow_clone();
        // The same layer on the tokens padded by hand to 32.
        let padded = x.constant_pad_nd([0, 0, 0, 11]);
        let y32 = linear(&padded, &w, None, recipe).unwrap();
        let grad =
            Tensor::ones([21, 16], (Kind::Float, Device::Cpu)).constant_pad_nd([0, 0, 0, 11]);
        let gw32 = Tensor::run_backward(&[&(y32 * grad).sum(Kind::Float)], &[&w], false, false)[0]
            .shallow_clone();
        assert!(gw.equal(&gw32), "{recipe:?}: the padded weight gradient differs");
    }
}
