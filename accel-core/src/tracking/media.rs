//! What `log` records besides numbers: images, text and tables ([`Value`]), each written the
//! way its tracker stores such things (TensorBoard's image and text summaries, MLflow
//! artifacts, W&B media files, files beside `metrics.jsonl`).

use tch::{Kind, Tensor};

use crate::error::{Error, Result};

/// A value `log` records under a key: a number, or media.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A number (a loss, a rate): every tracker's scalar series.
    Scalar(f64),
    /// A picture.
    Image(Image),
    /// Text (Markdown where the tracker renders it: TensorBoard).
    Text(String),
    /// Rows under named columns.
    Table(Table),
}

impl Value {
    /// An image from a tensor: see [`Image::from_tensor`].
    pub fn image(tensor: &Tensor) -> Result<Self> {
        Image::from_tensor(tensor).map(Value::Image)
    }

    /// Text.
    pub fn text(text: impl Into<String>) -> Self {
        Value::Text(text.into())
    }

    /// A table: `columns`, and `rows` of as many JSON values each.
    pub fn table(
        columns: impl IntoIterator<Item = impl Into<String>>,
        rows: Vec<Vec<serde_json::Value>>,
    ) -> Result<Self> {
        Table::new(columns, rows).map(Value::Table)
    }

    /// What kind of value it is, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Scalar(_) => "number",
            Value::Image(_) => "image",
            Value::Text(_) => "text",
            Value::Table(_) => "table",
        }
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Scalar(v)
    }
}

impl From<f32> for Value {
    fn from(v: f32) -> Self {
        Value::Scalar(f64::from(v))
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Text(v.to_owned())
    }
}

impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Text(v)
    }
}

impl From<Image> for Value {
    fn from(v: Image) -> Self {
        Value::Image(v)
    }
}

impl From<Table> for Value {
    fn from(v: Table) -> Self {
        Value::Table(v)
    }
}

/// An 8-bit image, rows of pixels of 1 (grey) or 3 (RGB) channels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// Rows.
    pub height: u32,
    /// Pixels per row.
    pub width: u32,
    /// 1 (grey) or 3 (RGB).
    pub channels: u8,
    /// `height × width × channels` bytes, row by row, channels interleaved.
    pub pixels: Vec<u8>,
}

impl Image {
    /// An image from a tensor `[H, W]` (grey) or `[C, H, W]` with C = 1 or 3 (torchvision's
    /// and TensorBoard's `CHW`): floating point values in [0, 1] (clamped), or `uint8`.
    pub fn from_tensor(tensor: &Tensor) -> Result<Self> {
        let shape = tensor.size();
        let (channels, height, width) = match shape.as_slice() {
            [h, w] => (1, *h, *w),
            [c @ (1 | 3), h, w] => (*c, *h, *w),
            _ => {
                return Err(Error::Config(format!(
                    "an image is a tensor [H, W] or [C, H, W] with 1 or 3 channels, got shape \
                     {shape:?}"
                )));
            }
        };
        let chw = tensor.f_to_device(tch::Device::Cpu)?.f_reshape([channels, height, width])?;
        let bytes = match chw.kind() {
            Kind::Uint8 => chw,
            _ if chw.is_floating_point() => chw
                .f_to_kind(Kind::Float)?
                .f_clamp(0.0, 1.0)?
                .f_mul_scalar(255.0)?
                .f_round()?
                .f_to_kind(Kind::Uint8)?,
            kind => {
                return Err(Error::Config(format!(
                    "an image tensor holds floats in [0, 1] or uint8, got {kind:?}"
                )));
            }
        };
        let hwc = bytes.f_permute([1, 2, 0])?.f_contiguous()?;
        let pixels = Vec::<u8>::try_from(hwc.f_flatten(0, -1)?)?;
        Ok(Self { height: height as u32, width: width as u32, channels: channels as u8, pixels })
    }

    /// The image as a PNG file's bytes.
    pub fn png(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, self.width, self.height);
        encoder.set_color(if self.channels == 3 {
            png::ColorType::Rgb
        } else {
            png::ColorType::Grayscale
        });
        encoder.set_depth(png::BitDepth::Eight);
        let encode = |e: png::EncodingError| Error::Tracker(format!("encoding a PNG: {e}"));
        let mut writer = encoder.write_header().map_err(encode)?;
        writer.write_image_data(&self.pixels).map_err(encode)?;
        writer.finish().map_err(encode)?;
        Ok(out)
    }
}

/// Rows of JSON values under named columns.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// The columns' names.
    pub columns: Vec<String>,
    /// The rows, each with one value per column.
    pub rows: Vec<Vec<serde_json::Value>>,
}

impl Table {
    /// A table; every row must have one value per column.
    pub fn new(
        columns: impl IntoIterator<Item = impl Into<String>>,
        rows: Vec<Vec<serde_json::Value>>,
    ) -> Result<Self> {
        let columns: Vec<String> = columns.into_iter().map(Into::into).collect();
        if let Some((i, row)) = rows.iter().enumerate().find(|(_, r)| r.len() != columns.len()) {
            return Err(Error::Config(format!(
                "table row {i} has {} values for {} columns ({columns:?})",
                row.len(),
                columns.len()
            )));
        }
        Ok(Self { columns, rows })
    }

    /// `{"columns": [...], "data": [[...], ...]}`: W&B's and MLflow's table files.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({ "columns": self.columns, "data": self.rows })
    }

    /// A Markdown table (what TensorBoard's text plugin renders as one).
    pub fn markdown(&self) -> String {
        let cell = |v: &serde_json::Value| match v {
            serde_json::Value::String(s) => s.replace('|', "\\|"),
            other => other.to_string(),
        };
        let mut out = format!("| {} |\n", self.columns.join(" | "));
        out.push_str(&format!("|{}\n", " --- |".repeat(self.columns.len())));
        for row in &self.rows {
            out.push_str(&format!(
                "| {} |\n",
                row.iter().map(cell).collect::<Vec<_>>().join(" | ")
            ));
        }
        out
    }
}

/// The lowercase hex SHA-256 of `bytes` (W&B names and checks media files by it).
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A file name from a key (`eval/digits` → `eval_digits`): what is safe in a path.
pub(crate) fn file_stem(key: &str) -> String {
    key.chars()
        .map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_come_from_hw_and_chw_tensors_and_encode_to_png() {
        let grey = Tensor::from_slice(&[0.0f32, 0.5, 1.0, 2.0]).view([2, 2]);
        let image = Image::from_tensor(&grey).unwrap();
        assert_eq!((image.height, image.width, image.channels), (2, 2, 1));
        assert_eq!(image.pixels, [0, 128, 255, 255]);
        let rgb = Tensor::arange(12, (Kind::Uint8, tch::Device::Cpu)).view([3, 2, 2]);
        let image = Image::from_tensor(&rgb).unwrap();
        // Channel-interleaved: the first pixel is (0, 4, 8).
        assert_eq!(&image.pixels[..6], [0, 4, 8, 1, 5, 9]);
        let png = image.png().unwrap();
        let decoder = png::Decoder::new(std::io::Cursor::new(png));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height, info.color_type), (2, 2, png::ColorType::Rgb));
        assert_eq!(&buf[..info.buffer_size()], image.pixels.as_slice());
        let err = Image::from_tensor(&Tensor::zeros([2, 2, 2], (Kind::Float, tch::Device::Cpu)));
        assert!(err.unwrap_err().to_string().contains("1 or 3 channels"));
    }

    #[test]
    fn tables_check_their_rows_and_render_as_json_and_markdown() {
        let table = Table::new(["digit", "guess"], vec![vec![3.into(), "8".into()]]).unwrap();
        assert_eq!(
            table.json(),
            serde_json::json!({"columns": ["digit", "guess"], "data": [[3, "8"]]})
        );
        assert_eq!(table.markdown(), "| digit | guess |\n| --- | --- |\n| 3 | 8 |\n");
        let err = Table::new(["a"], vec![vec![1.into(), 2.into()]]).unwrap_err().to_string();
        assert!(err.contains("row 0 has 2 values for 1 columns"), "{err}");
    }
}
