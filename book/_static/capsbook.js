// Calls fn 150 ms after the window's width last changed (a phone turned, a window resized; not the height
// changes of a mobile browser's address bar).
function capsbookOnWidthChange(fn) {
  var lastWidth = window.innerWidth, timer = null;
  window.addEventListener("resize", function () {
    if (window.innerWidth === lastWidth) return;
    lastWidth = window.innerWidth;
    clearTimeout(timer);
    timer = setTimeout(fn, 150);
  });
}

// Figures stay legible on narrow screens. A figure is drawn for the page's column, its smallest text at
// least 12 px there (tests/test_outputs.py); where the column is narrower (a phone), the browser would
// shrink it until its tick labels are a few pixels high. Two things prevent that:
// - a figure that has a phone drawing (capslib.book.reflow: its panels re-laid for a column of about 350 px;
//   the image carries the class capsbook-narrow-<h>, and the drawing is _static/frames/<h>/narrow.png) shows
//   that drawing wherever its output column is narrower than NARROW_BELOW of the figure's width, at the
//   drawing's own width (a retina PNG: half its pixel width), and the figure again where the column widens;
// - an output image never shrinks below 1 / MAX_SHRINK of its figure size (the width its output declares,
//   else its natural width), so its smallest text stays at least 9 px high; below that its output area
//   scrolls sideways.
(function () {
  var MAX_SHRINK = 1.33, NARROW_BELOW = 0.8;
  function base() {
    var s = document.querySelector('script[src*="capsbook.js"]');
    return s ? s.src.replace(/capsbook[.]js[^/]*$/, "") : null;
  }
  function phoneDrawing(img) {
    var m = /(?:^|\s)capsbook-narrow-([0-9a-f]{16})(?:\s|$)/.exec(img.className);
    return m && base() ? base() + "frames/" + m[1] + "/narrow.png" : null;
  }
  function declaredWidth(img) {
    return parseFloat(img.getAttribute("width")) || parseFloat(img.style.width) || img.naturalWidth;
  }
  function keepLegible(img) {
    var declared = declaredWidth(img);
    if (!declared) return;
    img.style.minWidth = (declared / MAX_SHRINK).toFixed(0) + "px";
    var box = img.closest("div.cell_output, div.output");
    if (box) box.style.overflowX = "auto";
  }
  // shows the phone drawing or the figure, whichever the column asks for; true when the source changed
  function choose(img) {
    var phone = phoneDrawing(img);
    if (!phone) return false;
    if (!img.dataset.wideSrc) {
      img.dataset.wideSrc = img.getAttribute("src");
      img.dataset.wideWidth = String(declaredWidth(img) || "");
      img.dataset.wideStyleWidth = img.style.width || "";
    }
    var box = img.closest("div.cell_output, div.output") || img.parentElement;
    var column = box ? box.clientWidth : window.innerWidth;
    var narrow = column > 0 && column < NARROW_BELOW * parseFloat(img.dataset.wideWidth);
    var want = narrow ? phone : img.dataset.wideSrc;
    if (img.getAttribute("src") === want) return false;
    img.style.minWidth = "";
    if (narrow) {
      img.removeAttribute("width");
      img.style.width = "";
      img.dataset.phone = "1";
    } else {
      img.setAttribute("width", img.dataset.wideWidth);
      img.style.width = img.dataset.wideStyleWidth;
      delete img.dataset.phone;
    }
    img.src = want;
    return true;
  }
  function loaded(img) {
    if (img.dataset.phone && img.naturalWidth) img.setAttribute("width", Math.round(img.naturalWidth / 2));
    keepLegible(img);
  }
  // every image load in an output (the figure, its phone drawing, a player's next frame) sizes it again
  document.addEventListener("load", function (ev) {
    var img = ev.target;
    if (img.tagName === "IMG" && img.closest("div.cell_output, div.output")) loaded(img);
  }, true);
  function all() {
    document.querySelectorAll("div.cell_output img, div.output img").forEach(function (img) {
      if (choose(img)) return;
      if (img.complete && img.naturalWidth) loaded(img);
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", all);
  else all();
  capsbookOnWidthChange(all);
})();

// Display equations fit their column. Where an equation and its number do not fit side by side, the
// number goes below the equation (class capsbook-eq-stack); an equation still wider than the column is
// set in a smaller font, down to MIN_SCALE of its size (a phone's column is about 350 px); one that is
// wider even then scrolls sideways inside its own box. Done once MathJax has typeset the page, and
// again when the window changes width. The browser test (tests/test_browser.py) fails on any display
// equation wider than its column or running under its number.
(function () {
  var MIN_SCALE = 0.62, GAP = 6;
  function fitOne(d) {
    var c = d.querySelector("mjx-container"), m = c && c.querySelector("mjx-math");
    if (!m) return;
    c.style.fontSize = "";
    c.style.overflowX = "";
    d.classList.remove("capsbook-eq-stack");
    var no = d.querySelector("span.eqno");
    var column = d.clientWidth, width = m.getBoundingClientRect().width;
    if (!column || !width) return;
    var beside = no ? no.getBoundingClientRect().width + GAP : 0;
    if (width <= column - beside) return;                // centred in the line beside the number
    if (no) d.classList.add("capsbook-eq-stack");
    if (width <= column) return;
    var size = parseFloat(getComputedStyle(c).fontSize);
    var scale = Math.max(MIN_SCALE, (column - 2) / width);
    c.style.fontSize = (size * scale).toFixed(2) + "px";
    if (m.getBoundingClientRect().width > column) c.style.overflowX = "auto";
  }
  function fitAll() {
    document.querySelectorAll("div.math").forEach(fitOne);
    document.documentElement.dataset.capsbookMath = "fitted";
  }
  var started = Date.now();
  (function whenTypeset() {
    var mj = window.MathJax;
    if (mj && mj.startup && mj.startup.promise) mj.startup.promise.then(fitAll);
    else if (Date.now() - started < 60000) setTimeout(whenTypeset, 100);
  })();
  capsbookOnWidthChange(fitAll);
})();

// Tables of many columns read as cards on a phone. Squeezed into a phone's column, a table of five or more
// columns breaks its headers and numbers mid-word; instead each row becomes a card, one line per cell with its
// column's header beside it (capsbook.css, below 700 px). The header of each cell is found through the table's
// grid (header rows with column spans; body cells spanning rows, as pandas writes grouped indices).
(function () {
  var MIN_COLUMNS = 5;
  function headerNames(table) {
    var head = table.tHead;
    if (!head || !head.rows.length) return null;
    var width = 0, grid = Array.from(head.rows).map(function (tr) {
      var out = [];
      Array.from(tr.cells).forEach(function (c) {
        for (var k = 0; k < (c.colSpan || 1); k++) out.push(c.textContent.trim());
      });
      width = Math.max(width, out.length);
      return out;
    });
    var names = [];
    for (var j = 0; j < width; j++) {
      var parts = [];
      grid.forEach(function (row) {
        var t = row[j];
        if (t && parts.indexOf(t) < 0) parts.push(t);
      });
      names.push(parts.join(" · "));
    }
    return names;
  }
  function asCards(table) {
    var names = headerNames(table);
    if (!names || names.length < MIN_COLUMNS) return;
    Array.from(table.tBodies).forEach(function (body) {
      var spanning = [];                        // per column: how many more rows a cell above still covers
      Array.from(body.rows).forEach(function (tr) {
        var j = 0;
        Array.from(tr.cells).forEach(function (c) {
          while (spanning[j] > 0) { spanning[j] -= 1; j += 1; }
          if (names[j]) c.setAttribute("data-label", names[j]);
          for (var k = 0; k < (c.colSpan || 1); k++) spanning[j + k] = (c.rowSpan || 1) - 1;
          j += c.colSpan || 1;
        });
        for (; j < spanning.length; j++) if (spanning[j] > 0) spanning[j] -= 1;
      });
    });
    table.classList.add("capsbook-cards");
  }
  function all() {
    document.querySelectorAll("article table").forEach(asCards);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", all);
  else all();
})();

// On a phone, a code name in a table cell (a notebook's name, a function) may end a line after an underscore or a
// dot: a <wbr> goes there, so that, as such code keeps its words whole there (capsbook.css),
// "a3_soft_routing_gradients" breaks between its words instead of at any letter. A page opened wider keeps the name
// whole (no <wbr>) until its window is narrowed to a phone's width; the <wbr> then stay (a name that fits is not
// broken at them).
(function () {
  function breakable(code) {
    if (code.hasAttribute("data-capsbook-wbr")) return;
    code.setAttribute("data-capsbook-wbr", "");
    var walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT), nodes = [];
    for (var n = walker.nextNode(); n; n = walker.nextNode()) nodes.push(n);
    nodes.forEach(function (n) {
      var parts = n.textContent.split(/([_.])/);    // text, separator, text, ... (no lookbehind: older Safari)
      if (parts.length < 3) return;
      var frag = document.createDocumentFragment();
      for (var k = 0; k < parts.length; k += 2) {
        frag.appendChild(document.createTextNode(parts[k] + (k + 1 < parts.length ? parts[k + 1] : "")));
        if (k + 2 < parts.length) frag.appendChild(document.createElement("wbr"));
      }
      n.parentNode.replaceChild(frag, n);
    });
  }
  function all() {
    if (!window.matchMedia("(max-width: 700px)").matches) return;
    document.querySelectorAll("article table td code, article table th code").forEach(breakable);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", all);
  else all();
  capsbookOnWidthChange(all);
})();
