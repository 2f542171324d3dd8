// Figures stay legible on narrow screens. A figure is drawn for the page's column; where the column
// is narrower (a phone), the browser would shrink it until its tick labels are a few pixels high.
// Instead, an output image never shrinks below 1 / MAX_SHRINK of its figure size (the width its
// output declares, else its natural width), and its output area scrolls sideways.
(function () {
  var MAX_SHRINK = 1.75;
  function keepLegible(img) {
    var declared = parseFloat(img.getAttribute("width")) || parseFloat(img.style.width) || img.naturalWidth;
    if (!declared) return;
    img.style.minWidth = (declared / MAX_SHRINK).toFixed(0) + "px";
    var box = img.closest("div.cell_output, div.output");
    if (box) box.style.overflowX = "auto";
  }
  function all() {
    document.querySelectorAll("div.cell_output img, div.output img").forEach(function (img) {
      if (img.complete && img.naturalWidth) keepLegible(img);
      else img.addEventListener("load", function () { keepLegible(img); }, { once: true });
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", all);
  else all();
})();
